"""The bounded per-job stream and the self-pruning member locks."""

from __future__ import annotations

import json

import anyio
import pytest

from runner.job_stream import JobStream, ndjson_line
from runner.member_locks import MemberLocks

pytestmark = pytest.mark.anyio

RECEIPT = {"type": "receipt", "receipt": {"job_id": "j1"}}


def delta(i: int) -> dict[str, object]:
    return {"type": "event", "kind": "text", "text": f"delta {i:05d}"}


async def test_an_absent_reader_costs_at_most_the_budget_then_sees_the_cut_and_the_receipt() -> None:
    stream = JobStream(budget_bytes=1000)
    size = len(ndjson_line(delta(0)))
    for i in range(10_000):
        stream.emit(delta(i))
        assert stream.buffered_bytes <= 1000
    kept = 1000 // size
    assert stream.dropped == 10_000 - kept
    stream.finish(RECEIPT)
    events = [e async for e in stream.events()]
    assert events[:kept] == [delta(i) for i in range(kept)]
    assert events[kept:] == [{"type": "cut", "reason": "slow_reader", "dropped": 10_000 - kept, "budget_bytes": 1000},
                             RECEIPT]


async def test_a_reader_that_keeps_up_gets_every_event_and_no_cut() -> None:
    stream = JobStream(budget_bytes=200)
    got: list[dict[str, object]] = []

    async def read() -> None:
        async for e in stream.events():
            got.append(e)

    async with anyio.create_task_group() as tg:
        tg.start_soon(read)
        for i in range(500):
            stream.emit(delta(i))
            await anyio.sleep(0)  # the reader runs between events
        stream.finish(RECEIPT)
    assert got == [delta(i) for i in range(500)] + [RECEIPT]


async def test_after_the_first_drop_nothing_more_is_kept_even_if_room_comes_back() -> None:
    stream = JobStream(budget_bytes=len(ndjson_line(delta(0))))
    stream.emit(delta(0))
    stream.emit(delta(1))  # dropped: no room
    lines = stream.lines()
    assert json.loads(await lines.__anext__()) == delta(0)  # room again
    stream.emit(delta(2))
    stream.finish(RECEIPT)
    rest = [json.loads(line) async for line in lines]
    assert rest == [{"type": "cut", "reason": "slow_reader", "dropped": 2, "budget_bytes": stream.budget_bytes},
                    RECEIPT]


async def test_a_reader_that_leaves_frees_the_buffer_and_later_events_are_ignored() -> None:
    stream = JobStream(budget_bytes=10_000)
    for i in range(10):
        stream.emit(delta(i))
    lines = stream.lines()
    await lines.__anext__()
    await lines.aclose()
    assert stream.buffered_bytes == 0
    stream.emit(delta(99))
    stream.finish(RECEIPT)
    assert stream.buffered_bytes == 0


async def test_chunks_carry_what_queued_up_in_one_write_and_whole_lines_only() -> None:
    stream = JobStream(budget_bytes=10_000)
    for i in range(3):
        stream.emit(delta(i))
    chunks = stream.chunks()
    assert await chunks.__anext__() == b"".join(ndjson_line(delta(i)) for i in range(3))  # one chunk, three lines
    stream.emit(delta(3))
    assert await chunks.__anext__() == ndjson_line(delta(3))
    stream.emit(delta(4))
    stream.finish(RECEIPT)
    assert [c async for c in chunks] == [ndjson_line(delta(4)) + ndjson_line(RECEIPT)]
    assert stream.buffered_bytes == 0


async def test_member_locks_exist_only_while_held_or_awaited() -> None:
    locks = MemberLocks()
    order: list[str] = []
    key = ("u1", "c1", "m1")

    async def turn(name: str, hold: anyio.Event) -> None:
        async with locks.hold(key):
            order.append(f"{name} in")
            await hold.wait()
            order.append(f"{name} out")

    first, second = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(turn, "a", first)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(turn, "b", second)
        await anyio.wait_all_tasks_blocked()
        assert (locks.busy(key), locks.chat_busy("u1", "c1"), len(locks)) == (True, True, 1)
        first.set()
        await anyio.wait_all_tasks_blocked()
        assert locks.busy(key)  # b holds it now
        second.set()
    assert order == ["a in", "a out", "b in", "b out"]
    assert (locks.busy(key), locks.chat_busy("u1", "c1"), len(locks)) == (False, False, 0)
    for i in range(1000):
        async with locks.hold(("u", f"c{i}", "m")):
            pass
    assert len(locks) == 0


async def test_hold_all_takes_keys_in_one_order_so_crossed_callers_do_not_deadlock() -> None:
    locks = MemberLocks()
    a, b = ("u", "c", "a"), ("u", "c", "b")
    done: list[str] = []

    async def both(name: str, keys: list[tuple[str, str, str]]) -> None:
        for _ in range(50):
            async with locks.hold_all(keys):
                await anyio.sleep(0)
        done.append(name)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(both, "ab", [a, b])
            tg.start_soon(both, "ba", [b, a])
    assert sorted(done) == ["ab", "ba"] and len(locks) == 0


async def test_try_hold_never_waits_and_refuses_a_held_or_awaited_lock() -> None:
    locks = MemberLocks()
    key = ("u", "c", "m")
    held = locks.try_hold(key)
    assert held is not None
    async with held:
        assert locks.busy(key) and locks.try_hold(key) is None
    assert len(locks) == 0
    async with locks.hold(key):
        assert locks.try_hold(key) is None
    assert len(locks) == 0
