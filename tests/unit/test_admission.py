"""The fair queue, the sandbox room and the admission controller (pure / in-memory)."""

from __future__ import annotations

import anyio
import pytest

from runner.admission import Admission, HostBusy, QueuedEvent
from runner.fair_queue import FairQueue
from runner.sandbox_room import Placement, SandboxRoom

pytestmark = pytest.mark.anyio


def test_fifo_within_a_user_round_robin_across_users() -> None:
    q: FairQueue[str] = FairQueue()
    for i in range(100):
        q.push("a", f"a{i}")
    q.push("b", "b0")
    q.push("c", "c0")
    q.push("c", "c1")
    assert list(q.order())[:6] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert q.positions()["b0"] == 2 and q.positions()["a99"] == 103
    served = [q.pop() for _ in range(len(q))]
    assert served[:6] == ["a0", "b0", "c0", "a1", "c1", "a2"]
    assert served[6:] == [f"a{i}" for i in range(3, 100)]
    assert (len(q), q.users(), q.pop()) == (0, 0, None)


def test_positions_follow_the_ring_as_it_turns_and_users_join() -> None:
    q: FairQueue[str] = FairQueue()
    for item in ("a1", "a2", "a3"):
        q.push("a", item)
    assert q.positions() == {"a1": 1, "a2": 2, "a3": 3}
    q.push("b", "b1")
    assert q.positions() == {"a1": 1, "b1": 2, "a2": 3, "a3": 4}
    assert q.pop() == "a1"
    assert q.positions() == {"b1": 1, "a2": 2, "a3": 3}
    assert q.remove("a", "a2") and not q.remove("a", "a2") and not q.remove("z", "a3")
    assert q.positions() == {"b1": 1, "a3": 2}
    assert [q.pop() for _ in range(2)] == ["b1", "a3"]


def test_the_room_stops_the_least_recently_used_idle_sandbox_never_a_busy_one() -> None:
    clock = iter(range(1000)).__next__
    busy: set[tuple[str, str]] = set()
    room = SandboxRoom(2, busy=busy.__contains__, clock=lambda: float(clock()))
    a, b, c, d = ("u", "a"), ("u", "b"), ("v", "c"), ("v", "d")
    assert room.place(a) == Placement() and room.place(b) == Placement()
    room.mark_running(a)
    room.mark_running(b)
    assert room.place(c) is None  # both admitted (in a turn): nothing can be stopped
    room.release(a)  # a's turn ended: a is idle and the least recently used
    room.release(b)
    busy.add(a)  # ... but a member lock of a is held
    assert room.place(c) == Placement(victim=b)
    assert room.place(d) is None  # b is already being stopped for c; a is busy
    assert room.place(b) is None  # a job for the sandbox being stopped waits for the stop
    room.mark_stopped(b)
    room.mark_running(c)
    busy.clear()
    assert room.place(a) == Placement()  # its sandbox runs: no room needed
    room.release(a)
    room.release(c)
    assert room.place(b) == Placement(victim=a)  # a (used before c) is the LRU idle one


def test_an_unlimited_room_never_stops_anything() -> None:
    room = SandboxRoom(None, busy=lambda chat: False)
    for i in range(50):
        assert room.place(("u", f"c{i}")) == Placement()
        room.mark_running(("u", f"c{i}"))


async def test_admission_is_fair_and_reports_positions() -> None:
    room = SandboxRoom(None, busy=lambda chat: False)
    adm = Admission(max_turns=1, timeout_s=10, room=room)
    events: dict[str, list[int]] = {}
    order: list[str] = []
    gate = anyio.Event()

    async def job(user: str, name: str) -> None:
        grant = await adm.admit(user, f"chat-{name}", name, lambda ev: events.setdefault(name, []).append(ev.position))
        order.append(name)
        if name == "a1":
            await gate.wait()
        adm.release(grant)

    async with anyio.create_task_group() as tg:
        tg.start_soon(job, "a", "a1")
        await anyio.wait_all_tasks_blocked()
        for name in ("a2", "a3", "a4"):
            tg.start_soon(job, "a", name)
            await anyio.wait_all_tasks_blocked()
        tg.start_soon(job, "b", "b1")
        await anyio.wait_all_tasks_blocked()
        assert adm.depth == 4 and adm.position_of("b", "b1") == 2 and adm.position_of("a", "a4") == 4
        gate.set()
    assert order == ["a1", "a2", "b1", "a3", "a4"]
    assert events == {"a2": [1], "a3": [2, 3, 2, 1], "a4": [3, 4, 3, 2, 1], "b1": [2, 1]}
    assert "a1" not in events  # admitted at once: never queued
    assert (adm.running, adm.depth, adm.host_busy) == (0, 0, 0)


async def test_a_job_still_waiting_at_the_timeout_is_host_busy_and_leaves_the_queue() -> None:
    adm = Admission(max_turns=1, timeout_s=0.2, room=SandboxRoom(None, busy=lambda chat: False))
    seen: list[QueuedEvent] = []
    first = await adm.admit("a", "c1", "j1", seen.append)
    with pytest.raises(HostBusy) as exc:
        await adm.admit("b", "c2", "j2", seen.append)
    assert (exc.value.retry_after_s, exc.value.position) == (1, 1) and exc.value.waited_ms >= 200
    assert [e.position for e in seen] == [1]
    assert (adm.depth, adm.running, adm.host_busy) == (0, 1, 1)
    adm.release(first)
    again = await adm.admit("b", "c2", "j2", seen.append)  # a re-dispatch later is admitted
    assert not again.queued and adm.running == 1


async def test_a_cancelled_wait_gives_back_its_place() -> None:
    adm = Admission(max_turns=1, timeout_s=10, room=SandboxRoom(None, busy=lambda chat: False))
    first = await adm.admit("a", "c1", "j1", lambda ev: None)
    with anyio.move_on_after(0.1):
        await adm.admit("b", "c2", "j2", lambda ev: None)
    assert (adm.depth, adm.running) == (0, 1)
    adm.release(first)
    assert adm.running == 0


async def test_the_front_job_waits_for_room_and_gets_the_victim() -> None:
    busy: set[tuple[str, str]] = set()
    room = SandboxRoom(1, busy=busy.__contains__)
    adm = Admission(max_turns=4, timeout_s=10, room=room)
    g1 = await adm.admit("a", "c1", "j1", lambda ev: None)
    room.mark_running(("a", "c1"))
    got: list[object] = []

    async def second() -> None:
        got.append(await adm.admit("b", "c2", "j2", lambda ev: None))

    async with anyio.create_task_group() as tg:
        tg.start_soon(second)
        await anyio.wait_all_tasks_blocked()
        assert got == [] and adm.position_of("b", "j2") == 1  # a turn slot is free, but no room
        adm.release(g1)  # c1 idle now: c2 is admitted with c1 to stop
    assert got[0].victim == ("a", "c1") and got[0].queued


def test_admits_at_once_agrees_with_a_grant_that_neither_waits_nor_stops_a_sandbox() -> None:
    """The supervisor skips its fence read for a job admitted at once (the claim answers a
    repeat): the prediction must never say "at once" for a job that would wait or evict."""
    room = SandboxRoom(1, busy=lambda chat: False, clock=lambda: 0.0)
    adm = Admission(max_turns=2, timeout_s=10, room=room)
    a, b = ("u", "a"), ("u", "b")
    assert adm.admits_at_once(a) and room.fits_at_once(a)
    assert room.place(a) == Placement()
    room.mark_running(a)
    assert adm.admits_at_once(a)  # its sandbox is already running: no room needed
    assert not adm.admits_at_once(b)  # the one sandbox slot is a's: b's needs a stop first
    room.release(a)
    assert room.place(b) == Placement(victim=a)  # ...as place() says
    assert not adm.admits_at_once(a)  # a is being stopped: its job waits for the stop
    room.mark_stopped(a)
    room.mark_running(b)
    assert adm.admits_at_once(b)
    adm.running = 2
    assert not adm.admits_at_once(b)  # no turn slot free
    adm.running = 0
    adm.queue.push("v", object())  # type: ignore[arg-type]
    assert not adm.admits_at_once(b)  # someone waits: a new job queues behind them


async def test_host_busy_has_waited_the_whole_queue_timeout_every_time() -> None:
    """A loop's timer may fire up to a millisecond early (uvloop's are millisecond-grained): the
    wait runs to the monotonic clock's deadline, so ``waited_ms`` is never under the timeout
    (one scope alone answered early in 19 of 300 such waits)."""
    short = []
    for _ in range(200):
        adm = Admission(max_turns=1, timeout_s=0.005, room=SandboxRoom(None, busy=lambda chat: False))
        await adm.admit("a", "c1", "j1", lambda e: None)
        with pytest.raises(HostBusy) as exc:
            await adm.admit("b", "c2", "j2", lambda e: None)
        if exc.value.waited_ms < 5:
            short.append(exc.value.waited_ms)
    assert short == []
