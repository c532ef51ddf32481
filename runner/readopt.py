"""After a daemon restart (SPEC 14): re-adopt each recorded keeper whose identity matches and
rebuild its resident session from the recorded snapshot (the next turn is ``LIVE``); retire
anything else (the member's next turn is ``RESTORED`` by the usual rules). A keeper that
answers with another identity is never trusted: nothing of its output is read.

A turn that was in flight comes back as a :class:`Pending`: the supervisor finishes it
(``TurnRunner.finish``) from the offset where it began, and commits it once. The turn is the
keeper's note (``runner.keepers``), or the store record's for a keeper of an image before notes.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import structlog
from pydantic import ValidationError

from drivers.models import Locator
from runner.keepers import KeeperHandle
from runner.processes import member_paths
from runner.residents import Resident
from runner.transport import exec_transport
from sandbox_manager.keeper_errors import KeeperError, KeeperIdentityMismatch
from state.contract import StoreContract
from state.jobs import Job
from state.keepers import KeeperNote, KeeperRecord
from state.receipts import Outcome, Receipt, SandboxInfo, Timings
from state.records import JobRecord, SandboxState

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
    for key, rec in list(records.items()):
        why = await _adopt_one(runner, key, rec, running_job_ids, result, records)
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


async def _adopt_one(runner, key, rec: KeeperRecord, running_job_ids: set[str], result: Readoption,
                     records: dict[tuple[str, str, str], KeeperRecord]) -> str | None:
    """None when adopted, else why not. A turn in flight in the keeper's note is put into
    ``records`` (the record then says what a store record of the turn would have)."""
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
    try:  # the sandbox's init seen from the host: the link to the keeper, the memory budget's readings
        info = await manager.engine.inspect(rec.container_id)
        init_pid = info.init_pid
    except Exception:  # noqa: BLE001 - the attach goes through an exec and readings fall back without it
        init_pid = None
    try:
        handle = await runner.keepers.attach(rec, init_pid)
    except KeeperIdentityMismatch as exc:
        log.error("keeper.identity_refused", member=key[2], detail=str(exc))
        return f"identity_mismatch: {exc}"
    except KeeperError as exc:
        return f"keeper_unavailable: {exc}"
    try:
        rec, why = await _with_note(handle, rec, running_job_ids)
    except KeeperError as exc:
        why = f"keeper_unavailable: {exc}"
    if why is not None:
        await handle.channel.detach()
        return why
    records[key] = rec
    turn_job = Job.model_validate_json(rec.turn.job_json) if rec.turn is not None else None
    driver = runner.driver(rec.runtime)
    saved = member.locator
    gateway = await runner.gateway(rec.runtime, *key)
    launch = driver.plan(member_paths(manager.member_dirs(member.home_member_id)), gateway,
                         Locator(id=saved.id, path=saved.path) if saved else None)
    transport = exec_transport(handle.channel)
    if runner.hooks.wrap_transport is not None:
        transport = runner.hooks.wrap_transport(transport, rec.runtime)
    session = driver.session(transport, launch)
    session.restore(rec.session)
    keepers = runner.keepers
    runner.pool.add(Resident(key=key, runtime=rec.runtime, session=session, container_id=rec.container_id,
                             pidfile=handle.paths.pidfile,  # the keeper's group: it and the CLI's tree below it
                             relay_socket=handle.paths.socket,
                             kill=lambda: keepers.kill(handle.container_id, handle.run_dir),
                             aclose=handle.channel.detach, keeper=handle, host_init_pid=init_pid))
    result.adopted.append(key)
    if turn_job is not None:
        result.pending.append(Pending(key, turn_job, rec))
    log.info("keeper.adopted", member=key[2], runtime=rec.runtime, acked=rec.acked,
             in_flight=turn_job.job_id if turn_job else None)
    return None


async def _with_note(handle: KeeperHandle, rec: KeeperRecord, running_job_ids: set[str]) -> tuple[KeeperRecord, str | None]:
    """The record with the keeper's turn note applied (the note's turn, if still running, is
    the turn in flight; its output is then read from where it began), or why not adopted."""
    text = handle.channel.hello.turn_note
    if text is None:
        return rec, None
    try:
        note = KeeperNote.model_validate_json(text)
        job = Job.model_validate_json(note.turn.job_json)
    except ValidationError as exc:
        return rec, f"turn_note_unreadable: {exc.errors()[0]['msg']}"
    if job.job_id not in running_job_ids:
        if note.turn.offset > rec.acked:
            # committed without the store's record moving past it: the snapshot predates
            # that turn, so this process is not trusted for the next one
            return rec, "snapshot_stale"
        return rec, None  # a turn already committed (its commit recorded where it ended)
    if rec.turn is not None:
        return rec, "two_turns_in_flight"  # never written so: nothing of it is trusted
    # the attach began at the store's acknowledged offset; the turn began at or after it
    await handle.channel.skip_to(note.turn.offset)
    return rec.model_copy(update={"turn": note.turn, "session": note.session}), None


async def abandon(store: StoreContract, running: list[JobRecord], records: dict[tuple[str, str, str], KeeperRecord]) -> None:
    """The jobs a dead daemon left running that no re-adopted keeper can finish never ran to
    commit: each is closed ``not_settled`` ``daemon_restarted`` (never re-run: the CLI may
    already have sent the message), with what its keeper record still knows."""
    for rec in running:
        member = await store.get_member(rec.user_id, rec.chat_id, rec.member_id)
        now = datetime.now(UTC)
        known = await _known_of(store, records.get((rec.user_id, rec.chat_id, rec.member_id)), rec.job_id)
        fields: dict[str, Any] = {"context_status": None, "started_at": rec.created_at, **known}
        receipt = Receipt(job_id=rec.job_id, user_id=rec.user_id, chat_id=rec.chat_id, member_id=rec.member_id,
                          runtime=member.runtime if member else "unknown",
                          outcome=Outcome.NOT_SETTLED, reason="daemon_restarted",
                          locator_before=member.locator.id if member and member.locator else None,
                          locator_after=member.locator.id if member and member.locator else None,
                          finished_at=now, **fields)
        await store.finish_job(rec.user_id, rec.job_id, receipt.model_dump_json(), None)
        log.warning("job.abandoned", job_id=rec.job_id, owner=rec.owner)


async def _known_of(store: StoreContract, keeper: KeeperRecord | None, job_id: str) -> dict[str, Any]:
    """What a turn that cannot be finished still reports (SPEC 14): the status its stream
    said, its sandbox, image, CLI version and the timings measured before it."""
    if keeper is None or keeper.turn is None or Job.model_validate_json(keeper.turn.job_json).job_id != job_id:
        return {}
    sb = await store.get_sandbox(keeper.user_id, keeper.chat_id)
    return {"context_status": keeper.turn.context_status, "started_at": keeper.turn.started_at,
            "timings_ms": Timings.model_validate_json(keeper.turn.timings_json),
            "cli_version": keeper.session.get("cli_version"),
            "sandbox": SandboxInfo(container_id=keeper.container_id,
                                   image_id=sb.image_id if sb and sb.container_id == keeper.container_id else None)}
