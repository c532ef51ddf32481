"""Native forks: a new member whose native session branches from another member's.

Each CLI forks with its own mechanism (protocols/ and the drivers):
* Codex — ``thread/fork {lastTurnId}`` in the source's CODEX_HOME (eager);
* Pi — ``get_fork_messages`` + ``fork {entryId}`` / ``clone`` into the new member's
  sessions dir (eager);
* OpenCode/Kilo — ``POST /session/{id}/fork {messageID}`` through the bridge (eager);
* Claude — ``--resume PARENT --fork-session [--resume-session-at UUID]`` when the new
  member's first turn starts (lazy: Claude writes nothing until a message arrives).

``at_turn=N`` keeps the first N native user turns; default: the whole history. Forks of
Codex, Claude and OpenCode/Kilo live in the source member's native home (Codex must never
see a relocated CODEX_HOME; Claude reads the parent transcript from its config dir); Pi's
fork file goes to the new member's own sessions dir.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import anyio
import structlog

from drivers.models import Locator
from drivers.registry import get_driver
from runner.processes import member_paths, start_in_sandbox
from runner.residents import ResidentPool
from runner.transport import exec_transport
from runner.turn import TurnRunner, to_locator, to_saved
from sandbox_manager.sandboxes import Sandbox, SandboxLost, SandboxManager
from state.jobs import ForkRequest
from state.records import MemberRecord, PendingFork
from state.store import Store

log = structlog.get_logger("fork")

EAGER_HOME_OF_SOURCE = {"codex", "opencode", "kilo"}


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
        key = (source.user_id, source.chat_id, source.member_id)
        try:
            sandbox = await self.manager.resolve(source.user_id, source.chat_id)
        except SandboxLost as lost:
            raise ForkError(409, "sandbox_lost", lost.reason.value) from None
        runtime = source.runtime
        parent = to_locator(source.locator)
        assert parent is not None
        if runtime == "claude":
            # settled_turns counts the native turns the fork inherits, as for the eager forks;
            # the locator stays None until Claude writes the fork at its first turn.
            created = await self.store.create_fork_member(
                source, req.new_member_id, home_member_id=source.home_member_id, locator=None,
                settled_turns=req.at_turn or source.settled_turns,
                pending=PendingFork(parent=to_saved(parent), at_turn=req.at_turn))
            locator: Locator | None = None
        else:
            # One writer per native session: the source's resident process goes first.
            await self.pool.retire(key, "fork")
            locator = await self._eager(runtime, sandbox, source, parent, req)
            home = req.new_member_id if runtime == "pi" else source.home_member_id
            created = await self.store.create_fork_member(
                source, req.new_member_id, home_member_id=home, locator=to_saved(locator),
                settled_turns=req.at_turn or source.settled_turns, pending=None)
        if created is None:
            raise ForkError(409, "member_exists", req.new_member_id)
        log.info("fork.created", runtime=runtime, source=source.member_id, member=req.new_member_id,
                 at_turn=req.at_turn, locator=str(locator) if locator else "pending")
        return {"member_id": created.member_id, "runtime": runtime, "forked_from": source.member_id,
                "at_turn": req.at_turn, "locator": None if locator is None else locator.model_dump(),
                "pending": locator is None}

    async def _eager(self, runtime: str, sandbox: Sandbox, source: MemberRecord, parent: Locator,
                     req: ForkRequest) -> Locator:
        driver = get_driver(runtime)
        gateway = self.runner.gateway(runtime)
        src_dirs = self.manager.member_dirs(source.home_member_id)
        if runtime == "pi":
            dirs = self.manager.member_dirs(req.new_member_id)
            launch = driver.plan_fork(member_paths(dirs), gateway, parent)  # type: ignore[attr-defined]
        elif runtime == "codex":
            dirs = src_dirs
            launch = driver.plan_fork(member_paths(dirs), gateway, parent)  # type: ignore[attr-defined]
        else:
            dirs = src_dirs
            launch = driver.plan(member_paths(dirs), gateway, parent)
        proc = await start_in_sandbox(self.manager, sandbox, dirs, launch, name="fork")
        session = driver.session(exec_transport(proc.stream), launch)
        try:
            with anyio.fail_after(self.runner.handshake_timeout_s):
                await session.handshake()
                if runtime == "codex":
                    last = None
                    if req.at_turn is not None:
                        ids = await session.list_turn_ids()  # type: ignore[attr-defined]
                        if req.at_turn > len(ids):
                            raise ForkError(422, "invalid_request", f"at_turn {req.at_turn} > {len(ids)} native turns")
                        last = ids[req.at_turn - 1]
                    return await session.fork(last_turn_id=last)  # type: ignore[attr-defined]
                if runtime == "pi":
                    return await session.fork(req.at_turn)  # type: ignore[attr-defined]
                return await session.fork_at_turn(req.at_turn)  # type: ignore[attr-defined]
        except ForkError:
            raise
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
