"""Native forks: a new member whose native session branches from another member's.

One path for every CLI, through the driver seam (drivers/base.py ``Driver.fork_mode``):
* **eager** (Codex ``thread/fork``, Pi ``fork``/``clone``, OpenCode/Kilo ``POST /session/{id}/fork``):
  the source's resident process is retired (one writer per native session), a fork process is
  started from ``Driver.plan_fork``, handshaken, and ``NativeSession.fork(at_turn)`` makes the
  fork; its locator is saved with the new member;
* **lazy** (Claude ``--resume PARENT --fork-session``): nothing runs now; the new member records a
  pending fork and its first turn starts the CLI with ``Driver.plan_fork`` (Claude writes nothing
  until a message arrives).

``at_turn=N`` keeps the first N native user turns; default: the whole history.
``Driver.fork_home`` says whose member home the fork process runs in and the fork's native state
lives in (the source's: Codex must never see a relocated CODEX_HOME, Claude reads the parent
transcript from its config dir; the new member's own: Pi's fork file).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from drivers.base import Driver, ForkPointMissing
from drivers.models import Locator
from runner.processes import member_paths, start_in_sandbox
from runner.residents import ResidentPool
from runner.transport import exec_transport
from runner.turn import TurnRunner
from runner.turn_context import to_locator, to_saved
from sandbox_manager.chat_containers import ImageRefused
from sandbox_manager.identity import SandboxLost
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandboxes import SandboxManager
from state.contract import VerifiedIn
from state.jobs import ForkRequest
from state.records import MemberRecord, PendingFork
from state.store import Store

log = structlog.get_logger("fork")


class ForkError(Exception):
    def __init__(self, status: int, code: str, detail: str = "") -> None:
        super().__init__(f"{code}: {detail}")
        self.status = status
        self.code = code
        self.detail = detail


@dataclass
class Forker:
    store: Store
    manager: SandboxManager
    pool: ResidentPool
    runner: TurnRunner

    async def check(self, source: MemberRecord | None, req: ForkRequest) -> MemberRecord:
        if source is None:
            raise ForkError(404, "not_found")
        if source.lost_reason is not None:
            raise ForkError(409, "member_lost", source.lost_reason)
        if source.locator is None or source.settled_turns == 0:
            raise ForkError(409, "nothing_to_fork", "the member has no settled native turn")
        if source.pending_fork is not None:
            raise ForkError(409, "nothing_to_fork", "the member is itself an unstarted fork")
        if req.at_turn is not None and req.at_turn > source.settled_turns:
            raise ForkError(422, "invalid_request", f"at_turn {req.at_turn} > {source.settled_turns} settled turns")
        if await self.store.get_member(source.user_id, source.chat_id, req.new_member_id) is not None:
            raise ForkError(409, "member_exists", req.new_member_id)
        return source

    async def fork(self, source: MemberRecord, req: ForkRequest) -> dict[str, Any]:
        try:
            sandbox = await self.runner.resolve_sandbox(source.user_id, source.chat_id)
        except SandboxLost as lost:
            raise ForkError(409, "sandbox_lost", lost.reason.value) from None
        except ImageRefused as exc:
            raise ForkError(409, "image_unsupported", str(exc)) from None
        try:
            return await self._fork(source, req, sandbox)
        finally:
            self.manager.release(sandbox)

    async def _fork(self, source: MemberRecord, req: ForkRequest, sandbox: Sandbox) -> dict[str, Any]:
        key = (source.user_id, source.chat_id, source.member_id)
        runtime = source.runtime
        parent = to_locator(source.locator)
        assert parent is not None
        driver = self.runner.driver(runtime)
        home = req.new_member_id if driver.fork_home == "new" else source.home_member_id
        # settled_turns counts the native turns the fork inherits, lazy or eager.
        inherited = req.at_turn or source.settled_turns
        locator: Locator | None = None
        if driver.fork_mode == "lazy":
            # the locator stays None until the CLI writes the fork at its first turn
            created = await self.store.create_fork_member(
                source, req.new_member_id, home_member_id=home, locator=None, settled_turns=inherited,
                pending=PendingFork(parent=to_saved(parent), at_turn=req.at_turn))
        else:
            # One writer per native session: the source's resident process goes first.
            await self.pool.retire(key, "fork")
            locator, cli_version = await self._eager(driver, sandbox, home, parent, req)
            created = await self.store.create_fork_member(
                source, req.new_member_id, home_member_id=home, locator=to_saved(locator), settled_turns=inherited,
                pending=None, where=VerifiedIn(sandbox.container_id, sandbox.image.id, cli_version))
        if created is None:
            raise ForkError(409, "member_exists", req.new_member_id)
        log.info("fork.created", runtime=runtime, source=source.member_id, member=req.new_member_id,
                 at_turn=req.at_turn, locator=str(locator) if locator else "pending")
        return {"member_id": created.member_id, "runtime": runtime, "forked_from": source.member_id,
                "at_turn": req.at_turn, "locator": None if locator is None else locator.model_dump(),
                "pending": locator is None}

    async def _eager(self, driver: Driver, sandbox: Sandbox, home: str, parent: Locator,
                     req: ForkRequest) -> tuple[Locator, str | None]:
        dirs = self.manager.member_dirs(home)
        gateway = await self.runner.gateway(driver.runtime, sandbox.record.user_id, sandbox.record.chat_id,
                                            req.new_member_id)
        launch = driver.plan_fork(member_paths(dirs), gateway, parent, req.at_turn)
        proc = await start_in_sandbox(self.manager, sandbox, dirs, launch, name="fork")
        session = driver.session(exec_transport(proc.stream), launch)
        try:
            with anyio.fail_after(self.runner.handshake_timeout_s):
                await session.handshake()
                return await session.fork(req.at_turn), session.cli_version
        except ForkPointMissing as exc:
            raise ForkError(422, "invalid_request", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - any driver failure is a failed fork, named
            raise ForkError(409, "fork_failed", f"{type(exc).__name__}: {exc}") from None
        finally:
            with anyio.CancelScope(shield=True):
                try:
                    await session.close()
                except Exception:  # noqa: BLE001
                    pass
                await self.manager.kill_group(proc.container_id, proc.pidfile)
                await proc.stream.aclose()
