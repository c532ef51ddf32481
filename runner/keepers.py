"""Residents under in-sandbox keepers (SPEC 14): start, record, acknowledge, re-attach.

The keeper (``ca-keeper``) owns the CLI's stdio inside the sandbox and keeps its output by
byte offset until acknowledged. The daemon acknowledges at turn boundaries only: after a turn
committed (and, for a keeper of an image before turn notes, when a turn begins). So while a
turn runs, the keeper holds all of that turn's output and a new daemon can re-read
it from the offset where the turn began. The store records, per member, the keeper's
identity, the driver session's snapshot and the acknowledged offset (``state.keepers``).

The turn in flight is the keeper's own note (frame T): written in front of the turn's input,
in the same write, so the keeper has it whenever it has the input, and no store write waits in
front of the CLI's input. The turn's start is then not acknowledged (the store's acknowledged
offset would fall behind the keeper's); the next daemon attaches from the store's offset and
reads past the output before the note's. A keeper of an image before notes gets the turn in
the store, as before.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import structlog

from drivers.base import Launch
from drivers.session import NativeSession, TurnStart
from runner.alongside import alongside
from runner.processes import launch_files
from runner.turn_context import InputNotReady
from sandbox_manager import keeper_sandbox
from sandbox_manager import keeper_wire as wire
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_errors import KeeperError
from sandbox_manager.keeper_identity import KeeperIdentity
from sandbox_manager.keeper_sandbox import KeeperPaths
from sandbox_manager.member_processes import MemberDirs
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandboxes import SandboxManager
from state.contract import StoreContract
from state.jobs import Job
from state.keepers import KeeperNote, KeeperRecord, KeeperTurn
from state.receipts import ContextStatus, Timings
from telemetry.turn_trace import mark

log = structlog.get_logger("keepers")

MemberKey = tuple[str, str, str]
# The keeper gives the note back inside its hello's JSON, escaped to ASCII (a character takes up
# to 12 there: a surrogate pair); the hello must fit one frame, with room for its other fields
NOTE_ROOM = wire.MAX_PAYLOAD - (64 << 10)


def note_fits(note: str) -> bool:
    """Whether ``note`` fits the keeper's hello (exactly, when the cheap bound says it may not)."""
    return len(note) * 12 <= NOTE_ROOM or len(json.dumps(note)) <= NOTE_ROOM


@dataclass
class KeeperHandle:
    """Our attach to one member's keeper."""

    channel: KeeperChannel
    paths: KeeperPaths
    container_id: str
    run_dir: str


class Keepers:
    def __init__(self, store: StoreContract, manager: SandboxManager, *, buffer_bytes: int,
                 link_from_host: bool = True) -> None:
        self.store = store
        self.manager = manager
        self.buffer_bytes = buffer_bytes
        self.link_from_host = link_from_host  # CLOUD_AGENT_KEEPER_LINK=host (else: exec only)

    async def start(self, sandbox: Sandbox, dirs: MemberDirs, launch: Launch, member_id: str) -> KeeperHandle:
        """Start the keeper and its CLI, the launch's files written first (one attached exec)."""
        spec = launch.spec
        # The keeper's run dir is the member's own, not its home's: a fork that shares its
        # source's home (SPEC 8) has a keeper of its own beside the source's, on another socket.
        run_dir = self.manager.member_dirs(member_id).run_dir
        files = launch_files(launch, [run_dir, dirs.home, dirs.workspace])
        paths = KeeperPaths.in_run_dir(run_dir)
        prefix = keeper_sandbox.run_prefix(paths, member=member_id, buffer_bytes=self.buffer_bytes,
                                           files_on_stdin=True)
        # the CLI starts once the model gate listens: a new sandbox is handed over before it does
        argv = spec.launcher_argv(pidfile=paths.cli_pidfile, launcher=prefix,
                                  await_listen=self.manager.model_endpoint)
        # The exec starts in the agent's home (always present); the launcher chdirs to spec.cwd.
        channel = await keeper_sandbox.start(self.manager.engine, sandbox.container_id, argv, env=dict(spec.env),
                                             workdir="/home/agent", files=files)
        mark("keeper_hello")
        # the turns' lines go to the keeper's socket from the host, not through the start's relay
        if self.link_from_host:
            channel = await keeper_sandbox.go_direct(channel, sandbox.init_pid, paths)
            mark("keeper_linked")
        return KeeperHandle(channel, paths, sandbox.container_id, run_dir)

    async def attach(self, rec: KeeperRecord, init_pid: int | None = None) -> KeeperHandle:
        """Re-attach from the acknowledged offset; any keeper but the recorded one is refused
        (``KeeperIdentityMismatch``) before anything of its output is read. ``init_pid``: the
        sandbox's init seen from the host, for a link that needs no exec."""
        paths = KeeperPaths.in_run_dir(rec.run_dir)
        channel = await keeper_sandbox.attach(self.manager.engine, rec.container_id, paths, from_offset=rec.acked,
                                              expect=KeeperIdentity.model_validate(rec.identity),
                                              init_pid=init_pid if self.link_from_host else None)
        return KeeperHandle(channel, paths, rec.container_id, rec.run_dir)

    async def kill(self, container_id: str, run_dir: str) -> None:
        """End the keeper and the CLI's process group (whoever answers on those paths)."""
        await keeper_sandbox.retire(self.manager.engine, container_id, KeeperPaths.in_run_dir(run_dir))

    def _record(self, key: MemberKey, runtime: str, handle: KeeperHandle, session: NativeSession,
                turn: KeeperTurn | None, *, acked: int | None = None) -> KeeperRecord:
        return KeeperRecord(user_id=key[0], chat_id=key[1], member_id=key[2], host_id=self.manager.config.host_id,
                            runtime=runtime, container_id=handle.container_id, run_dir=handle.run_dir,
                            identity=handle.channel.identity.model_dump(), session=session.snapshot(),
                            acked=handle.channel.acked if acked is None else acked, turn=turn)

    def after_turn(self, key: MemberKey, runtime: str, handle: KeeperHandle, session: NativeSession) -> KeeperRecord:
        """The record a turn's commit writes with its receipt: no turn in flight, everything the
        turn read committed. Acknowledge it to the keeper (:meth:`acknowledge`) only after the
        commit: a re-attach may start later than the keeper's own acknowledgement, never earlier."""
        return self._record(key, runtime, handle, session, None, acked=handle.channel.offset)

    @staticmethod
    async def acknowledge(handle: KeeperHandle, rec: KeeperRecord) -> None:
        await handle.channel.ack(rec.acked)

    async def settle(self, key: MemberKey, runtime: str, handle: KeeperHandle, session: NativeSession) -> None:
        """After a launch's handshake: everything read is committed, and the record is there for
        a daemon that restarts from now on (committed before the turn's input is sent).

        Not flushed to disk by itself (``sync=False``; the turn's commit flushes it): it serves
        a daemon that restarts while the keeper lives, and a crash of the machine takes the
        keeper too. A synchronous commit held every NEW and RESTORED turn for its fsync
        between the handshake and the input (``process_ready``: 1.5 ms at p50, Codex RESTORED)."""
        await handle.channel.ack()
        await self.store.put_keeper(self._record(key, runtime, handle, session, None), sync=False)

    async def begin_turn(self, key: MemberKey, runtime: str, handle: KeeperHandle, session: NativeSession,
                         job: Job, start: TurnStart, *, status: ContextStatus | None, started_at, timings: Timings,
                         input_ready: Callable[[], Awaitable[None]]) -> None:
        """Before the turn's opening is written: record where its output begins, and return once
        the input may go (``input_ready``: the claim's flush, the proxy's begin). A failed wait is
        raised as :class:`InputNotReady`, after the record is done."""
        channel = handle.channel
        turn = KeeperTurn(job_json=job.model_dump_json(), start_json=start.model_dump_json(),
                          offset=channel.offset, context_status=status.value if status else None,
                          started_at=started_at, timings_json=timings.model_dump_json())
        note = KeeperNote(turn=turn, session=session.snapshot()).model_dump_json() if channel.takes_notes else None
        noted = note if note is not None and note_fits(note) else None  # else the turn goes to the store
        failed: list[Exception] = []

        async def ready() -> None:
            try:
                await input_ready()
            except Exception as exc:  # noqa: BLE001 - raised below, once any record is done
                failed.append(exc)

        if noted is not None:
            await ready()  # the note has nothing to wait for: it goes with the input's own write
        else:  # in the store, beside the input's waits: an older keeper's turn, or a note too large
            await alongside(ready, lambda: self._record_turn(key, runtime, handle, session, turn))
        if failed:
            raise InputNotReady(failed[0])  # nothing was sent: raised past the driver's turn
        if noted is not None:
            try:
                channel.note_with_input(noted)
            except KeeperError:
                pass  # the link is gone: the turn's opening fails next, as the CLI's transport closing

    async def _record_turn(self, key: MemberKey, runtime: str, handle: KeeperHandle, session: NativeSession,
                           turn: KeeperTurn) -> None:
        await handle.channel.ack()  # the record says the same offset
        # Not flushed to disk (sync=False; the receipt's commit flushes it): the record serves
        # a daemon that restarts while the keeper lives, and a keeper outlives only what the
        # machine outlives. A crash of the machine takes the keeper and the page cache alike;
        # the turn is then closed as orphaned (the claim is on disk) and the member RESTORED.
        await self.store.put_keeper(self._record(key, runtime, handle, session, turn), sync=False)

    async def forget(self, key: MemberKey) -> None:
        await self.store.delete_keeper(*key)
