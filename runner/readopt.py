"""After a daemon restart (SPEC 14): re-adopt each recorded keeper whose identity matches and
rebuild its resident session from the recorded snapshot (the next turn is ``LIVE``); retire
anything else (the member's next turn is ``RESTORED`` by the usual rules). A keeper that
answers with another identity is never trusted: nothing of its output is read.

A turn that was in flight comes back as a :class:`Pending`: the supervisor finishes it
(``TurnRunner.finish``) from the offset where it began, and commits it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from drivers.models import Locator
from runner.processes import member_paths
from runner.residents import Resident
from runner.transport import exec_transport
from sandbox_manager.keeper import KeeperError, KeeperIdentityMismatch
from state.jobs import Job
from state.keepers import KeeperRecord
from state.records import SandboxState

log = structlog.get_logger("readopt")


@dataclass
class Pending:
    """A turn in flight when the previous daemon stopped, on a re-adopted keeper."""

    key: tuple[str, str, str]
    job: Job
    record: KeeperRecord


@dataclass
class Readoption:
    adopted: list[tuple[str, str, str]]
    refused: list[tuple[tuple[str, str, str], str]]  # (member, why)
    pending: list[Pending]

    def keep_dirs(self, records: dict[tuple[str, str, str], KeeperRecord]) -> dict[str, set[str]]:
        """Run dirs of adopted keepers per container (the orphan reaper leaves them alone)."""
        out: dict[str, set[str]] = {}
        for key in self.adopted:
            rec = records[key]
            out.setdefault(rec.container_id, set()).add(rec.run_dir)
        return out


async def readopt(runner, running_job_ids: set[str]) -> tuple[Readoption, dict[tuple[str, str, str], KeeperRecord]]:
    """``runner``: the :class:`~runner.turn.TurnRunner` (its store, manager, pool, keepers)."""
    keepers, store, manager = runner.keepers, runner.store, runner.manager
    result = Readoption([], [], [])
    records = {(r.user_id, r.chat_id, r.member_id): r for r in await store.list_keepers(manager.config.host_id)}
    for key, rec in records.items():
        why = await _adopt_one(runner, key, rec, running_job_ids, result)
        if why is None:
            continue
        result.refused.append((key, why))
        log.warning("keeper.not_adopted", member=key[2], runtime=rec.runtime, why=why)
        try:
            await keepers.kill(rec.container_id, rec.run_dir)
        except Exception as exc:  # noqa: BLE001 - the container may be gone; the reaper runs next
            log.info("keeper.kill_failed", error=repr(exc))
        await keepers.forget(key)
    return result, records


async def _adopt_one(runner, key, rec: KeeperRecord, running_job_ids: set[str], result: Readoption) -> str | None:
    """None when adopted, else why not."""
    store, manager = runner.store, runner.manager
    sb = await store.get_sandbox(key[0], key[1])
    if sb is None or sb.container_id != rec.container_id or sb.state != SandboxState.RUNNING:
        return "sandbox_changed"
    member = await store.get_member(*key)
    if member is None or member.lost_reason is not None or member.runtime != rec.runtime:
        return "member_changed"
    turn_job = Job.model_validate_json(rec.turn.job_json) if rec.turn is not None else None
    if turn_job is not None and turn_job.job_id not in running_job_ids:
        # committed, but the previous daemon died before recording the keeper between turns:
        # the snapshot predates that turn, so this process is not trusted for the next one
        return "snapshot_stale"
    try:
        handle = await runner.keepers.attach(rec)
    except KeeperIdentityMismatch as exc:
        log.error("keeper.identity_refused", member=key[2], detail=str(exc))
        return f"identity_mismatch: {exc}"
    except KeeperError as exc:
        return f"keeper_unavailable: {exc}"
    driver = runner.driver(rec.runtime)
    saved = member.locator
    launch = driver.plan(member_paths(manager.member_dirs(member.home_member_id)),
                         runner.gateway(rec.runtime, *key), Locator(id=saved.id, path=saved.path) if saved else None)
    transport = exec_transport(handle.channel)
    if runner.hooks.wrap_transport is not None:
        transport = runner.hooks.wrap_transport(transport, rec.runtime)
    session = driver.session(transport, launch)
    session.restore(rec.session)
    keepers = runner.keepers
    try:  # the sandbox's init seen from the host: the memory budget's readings (runner.resident_memory)
        info = await manager.engine.inspect(rec.container_id)
        init_pid = info.attrs.get("State", {}).get("Pid") or None
    except Exception:  # noqa: BLE001 - readings fall back; adoption does not depend on them
        init_pid = None
    runner.pool.add(Resident(key=key, runtime=rec.runtime, session=session, container_id=rec.container_id,
                             pidfile=handle.paths.pidfile,  # the keeper's group: it and the CLI's tree below it
                             kill=lambda: keepers.kill(handle.container_id, handle.run_dir),
                             aclose=handle.channel.detach, keeper=handle, host_init_pid=init_pid))
    result.adopted.append(key)
    if turn_job is not None:
        result.pending.append(Pending(key, turn_job, rec))
    log.info("keeper.adopted", member=key[2], runtime=rec.runtime, acked=rec.acked,
             in_flight=turn_job.job_id if turn_job else None)
    return None
