"""The turn in flight as the keeper's own note (SPEC 14, issue 16).

A LIVE turn on a keeper resident used to write its turn record to the store before the CLI's
input (a store round trip in front of every turn; p90 18 ms under 16 chats). A keeper that
takes notes is told the turn in the same write as the turn's input, and the store is not
written; a keeper of an image before notes gets the store record as before. The next daemon
reads the note from the keeper's hello (``runner.readopt``) and reads past the output before
the turn began. Real :class:`KeeperChannel` over in-memory bytes; the local keeper process's
side is in ``test_keeper_local``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from drivers.session import TurnStart
from runner.keepers import KeeperHandle, Keepers
from runner.readopt import _with_note
from runner.turn_context import InputNotReady
from sandbox_manager import keeper_wire as wire
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_errors import KeeperDetached
from sandbox_manager.keeper_sandbox import KeeperPaths
from state.jobs import Job
from state.keepers import KeeperNote, KeeperRecord, KeeperTurn
from state.receipts import ContextStatus, Timings
from tests.unit.test_keeper_channel import IDENT, FakeBytes, hello

pytestmark = pytest.mark.anyio

JOB = Job(job_id="j-2", user_id="u1", chat_id="c1", member_id="m1", runtime="pi", message="caf\u00e9 \u4e16")
KEY = ("u1", "c1", "m1")
BETWEEN = b'{"late":"line of the previous turn"}\n'
STARTED = datetime(2026, 12, 7, 9, 0, tzinfo=UTC)


class CountingStore:
    def __init__(self) -> None:
        self.keepers: list[tuple[KeeperRecord, bool]] = []

    async def put_keeper(self, rec: KeeperRecord, *, sync: bool = True) -> None:
        self.keepers.append((rec, sync))


class Session:
    def snapshot(self) -> dict[str, Any]:
        return {"turns": 1, "session_id": "s-1"}


async def attached(*, notes: bool) -> tuple[KeeperHandle, FakeBytes]:
    """A keeper resident between turns: a line read since the last commit's acknowledgement."""
    over = {"turn_notes": True} if notes else {}
    stream = FakeBytes([hello(**over) + wire.encode_data(0, BETWEEN)])
    channel = await KeeperChannel.open(stream, expect=IDENT)  # type: ignore[arg-type]
    assert await channel.receive() == BETWEEN[:-1]
    return KeeperHandle(channel, KeeperPaths.in_run_dir("/run/m1"), "ctr-1", "/run/m1"), stream


async def nothing_to_wait_for() -> None:
    pass


async def begin(handle: KeeperHandle, store: CountingStore, job: Job = JOB,
                input_ready: Callable[[], Awaitable[None]] = nothing_to_wait_for) -> None:
    keepers = Keepers(store, SimpleNamespace(config=SimpleNamespace(host_id="h1")),  # type: ignore[arg-type]
                      buffer_bytes=1 << 20)
    await keepers.begin_turn(KEY, "pi", handle, Session(), job, TurnStart(turn=2),  # type: ignore[arg-type]
                             status=ContextStatus.LIVE, started_at=STARTED, timings=Timings(sandbox=3),
                             input_ready=input_ready)


async def test_a_keeper_that_takes_notes_is_told_the_turn_with_its_input_and_the_store_is_not_written() -> None:
    handle, stream = await attached(notes=True)
    store = CountingStore()
    await begin(handle, store)
    assert store.keepers == []
    assert [kind for kind, _ in stream.frames()] == [b"A"]  # the note waits for the input
    await handle.channel.send(b'{"type":"prompt"}')
    assert stream.writes == 2  # the attach, then the note and the input in one write (the keeper wakes once)
    kinds = [kind for kind, _ in stream.frames()]
    assert kinds == [b"A", b"T", b"I"]  # no acknowledgement: the store's offset stays where it was
    await handle.channel.send(b'{"type":"steer"}')
    assert [kind for kind, _ in stream.frames()] == [b"A", b"T", b"I", b"I"]  # one note a turn
    note = KeeperNote.model_validate_json(stream.frames()[1][1])
    assert note.session == {"turns": 1, "session_id": "s-1"}
    assert note.turn.offset == len(BETWEEN) and handle.channel.acked == 0
    assert (Job.model_validate_json(note.turn.job_json), note.turn.context_status, note.turn.started_at) == (
        JOB, "LIVE", STARTED)
    assert (json.loads(note.turn.start_json), Timings.model_validate_json(note.turn.timings_json).sandbox) == (
        {"turn": 2}, 3)


async def test_a_keeper_of_an_older_image_gets_the_turn_in_the_store_as_before() -> None:
    handle, stream = await attached(notes=False)
    store = CountingStore()
    await begin(handle, store)
    assert [kind for kind, _ in stream.frames()] == [b"A", b"K"]
    assert stream.frames()[1][1] == len(BETWEEN).to_bytes(8, "big")
    [(rec, sync)] = store.keepers
    assert sync is False and rec.acked == len(BETWEEN) and rec.turn is not None
    assert (rec.turn.offset, Job.model_validate_json(rec.turn.job_json).job_id) == (len(BETWEEN), "j-2")


async def test_a_launch_records_its_keeper_between_turns_without_a_flush_of_its_own() -> None:
    """After a NEW or RESTORED handshake: the keeper acknowledged and recorded (no turn in
    flight, everything read committed) before the input, its commit left to the turn's flush:
    a synchronous commit held the turn for its fsync."""
    handle, stream = await attached(notes=True)
    store = CountingStore()
    keepers = Keepers(store, SimpleNamespace(config=SimpleNamespace(host_id="h1")),  # type: ignore[arg-type]
                      buffer_bytes=1 << 20)
    await keepers.settle(KEY, "pi", handle, Session())  # type: ignore[arg-type]
    assert [kind for kind, _ in stream.frames()] == [b"A", b"K"]  # the attach, then the acknowledgement
    assert stream.frames()[1][1] == len(BETWEEN).to_bytes(8, "big")
    [(rec, sync)] = store.keepers
    assert sync is False
    assert (rec.acked, rec.turn, rec.session, rec.host_id) == (len(BETWEEN), None, {"turns": 1, "session_id": "s-1"}, "h1")


def record(*, acked: int, turn: KeeperTurn | None = None) -> KeeperRecord:
    return KeeperRecord(user_id="u1", chat_id="c1", member_id="m1", host_id="h1", runtime="pi", container_id="ctr-1",
                        run_dir="/run/m1", identity=IDENT.model_dump(), session={"turns": 0}, acked=acked, turn=turn)


def a_turn(job_id: str, offset: int) -> KeeperTurn:
    return KeeperTurn(job_json=JOB.model_copy(update={"job_id": job_id}).model_dump_json(),
                      start_json='{"turn":2}', offset=offset, context_status="LIVE", started_at=STARTED,
                      timings_json=Timings().model_dump_json())


async def reattached(note: str | None, *, from_offset: int = 0) -> KeeperHandle:
    """The next daemon's attach from the store's offset: the keeper replays from there."""
    turn_output = b'{"type":"agent_start"}\n'
    stream = FakeBytes([hello(turn_notes=True, turn_note=note, acked=from_offset, written=100)
                        + wire.encode_data(from_offset, (BETWEEN + turn_output)[from_offset:])])
    channel = await KeeperChannel.open(stream, from_offset=from_offset, expect=IDENT)  # type: ignore[arg-type]
    return KeeperHandle(channel, KeeperPaths.in_run_dir("/run/m1"), "ctr-1", "/run/m1")


async def test_the_next_daemon_finishes_the_turn_in_the_note_from_where_it_began() -> None:
    note = KeeperNote(turn=a_turn("j-2", len(BETWEEN)), session={"turns": 1}).model_dump_json()
    handle = await reattached(note)
    rec, why = await _with_note(handle, record(acked=0), {"j-2"})
    assert why is None and rec.turn is not None
    assert (rec.turn.offset, rec.session, rec.acked) == (len(BETWEEN), {"turns": 1}, 0)
    # the line before the turn was read past: the turn's output is next
    assert handle.channel.offset == len(BETWEEN)
    assert await handle.channel.receive() == b'{"type":"agent_start"}'


@pytest.mark.parametrize(("note_offset", "acked", "why"), [
    (len(BETWEEN), len(BETWEEN), None),  # committed, and its commit recorded the keeper past it
    (len(BETWEEN), 0, "snapshot_stale"),  # committed without the store's record moving: not trusted
])
async def test_a_note_of_a_committed_turn_is_no_turn_in_flight(note_offset: int, acked: int, why: str | None) -> None:
    note = KeeperNote(turn=a_turn("j-1", note_offset), session={"turns": 1}).model_dump_json()
    handle = await reattached(note, from_offset=acked)
    rec, got = await _with_note(handle, record(acked=acked), {"j-9"})
    assert (got, rec.turn, rec.session) == (why, None, {"turns": 0})
    assert handle.channel.offset == acked  # nothing read past


async def test_an_unreadable_note_or_a_second_turn_refuses_the_keeper() -> None:
    handle = await reattached('{"turn": 1}')
    rec, why = await _with_note(handle, record(acked=0), {"j-2"})
    assert why is not None and why.startswith("turn_note_unreadable: ")
    note = KeeperNote(turn=a_turn("j-2", len(BETWEEN)), session={}).model_dump_json()
    handle = await reattached(note)
    rec, why = await _with_note(handle, record(acked=0, turn=a_turn("j-3", 0)), {"j-2", "j-3"})
    assert why == "two_turns_in_flight"


async def test_no_note_leaves_the_record_as_the_store_has_it() -> None:
    handle = await reattached(None)
    rec = record(acked=0, turn=a_turn("j-2", 0))
    assert await _with_note(handle, rec, {"j-2"}) == (rec, None)


async def test_a_note_the_keeper_never_got_lets_no_input_follow() -> None:
    """The link died between turns: the note's write (the input's) fails, and the turn's opening
    with it, as the CLI's transport closing (test_dead_resident: transport_closed, then
    RESTORED); no input reaches the keeper without its note after that."""
    handle, stream = await attached(notes=True)
    stream.closed = True
    store = CountingStore()
    await begin(handle, store)
    assert store.keepers == []
    with pytest.raises(KeeperDetached, match="the keeper link is gone"):
        await handle.channel.send(b'{"type":"prompt"}')
    stream.closed = False  # even a link that would take the next bytes gets no input now
    with pytest.raises(KeeperDetached, match="the keeper link is gone"):
        await handle.channel.send(b'{"type":"prompt"}')
    assert [kind for kind, _ in stream.frames()] == [b"A"]


async def test_a_failed_wait_for_the_input_leaves_no_note_to_send() -> None:
    """The claim's flush failed: raised as InputNotReady, and the next input carries no note of
    a turn the CLI never got."""
    handle, stream = await attached(notes=True)

    async def disk_failed() -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(InputNotReady) as raised:
        await begin(handle, CountingStore(), input_ready=disk_failed)
    assert isinstance(raised.value.cause, OSError)
    await handle.channel.send(b'{"type":"prompt"}')
    assert [kind for kind, _ in stream.frames()] == [b"A", b"I"]


async def test_an_older_keepers_record_is_written_while_the_input_waits() -> None:
    """The store record is begun beside the input's waits (the claim's flush, the proxy's
    begin), and begin_turn returns once both are done; a failed wait is raised after it."""
    handle, _ = await attached(notes=False)
    store = CountingStore()
    on_disk = anyio.Event()
    seen: list[int] = []

    async def flushed() -> None:
        await on_disk.wait()
        seen.append(len(store.keepers))

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: begin(handle, store, input_ready=flushed))
        with anyio.fail_after(5):
            while not store.keepers:
                await anyio.sleep(0.01)
        assert seen == []  # written while the flush is on its way
        on_disk.set()
    assert seen == [1]

    async def disk_failed() -> None:
        raise OSError(5, "Input/output error")

    with pytest.raises(InputNotReady):
        await begin(handle, store, input_ready=disk_failed)
    assert len(store.keepers) == 2  # the record is done before the failure is raised


async def test_a_note_the_keepers_hello_could_not_carry_goes_to_the_store() -> None:
    """The keeper gives the note back inside its hello, escaped to ASCII: 3 Mi characters of
    "é" are 6 MiB as the note's frame but 18 MiB in a hello, over a frame's 16 MiB, and the next
    daemon could never attach. Such a turn is recorded in the store, as for an older keeper."""
    handle, stream = await attached(notes=True)
    store = CountingStore()
    big = JOB.model_copy(update={"message": "\u00e9" * (3 << 20)})
    await begin(handle, store, big)
    assert [kind for kind, _ in stream.frames()] == [b"A", b"K"]
    [(rec, sync)] = store.keepers
    assert rec.turn is not None and Job.model_validate_json(rec.turn.job_json).message == big.message
    assert len(json.dumps(KeeperNote(turn=rec.turn, session=rec.session).model_dump_json())) > wire.MAX_PAYLOAD
