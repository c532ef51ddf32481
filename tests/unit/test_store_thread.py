"""The store's own thread (state.store_thread): calls in order on one thread, answers and errors
back to the caller, a queued call seen through under cancellation, the caller's context, and
the call queued before any other ready task runs (anyio's hop lets them all run first)."""

from __future__ import annotations

import contextvars
import threading

import anyio
import pytest

from state import store_thread
from state.store_thread import StoreThread

pytestmark = pytest.mark.anyio

who = contextvars.ContextVar("who", default="nobody")


async def test_calls_run_in_order_on_one_thread() -> None:
    st = StoreThread("t")
    seen: list[tuple[int, str]] = []

    async def call(i: int) -> None:
        await st.run(lambda: seen.append((i, threading.current_thread().name)))

    async with anyio.create_task_group() as tg:
        for i in range(20):
            tg.start_soon(call, i)
            await anyio.lowlevel.checkpoint()  # each task makes its call before the next starts
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"t"}
    assert threading.current_thread().name != "t"


async def test_answer_and_error_reach_the_caller() -> None:
    st = StoreThread()
    assert await st.run(lambda: 41 + 1) == 42

    def fails() -> None:
        raise KeyError("job-7")

    with pytest.raises(KeyError, match="job-7"):
        await st.run(fails)
    assert await st.run(lambda: "after") == "after"  # the thread goes on after an error


async def test_a_queued_call_is_seen_through_when_its_caller_is_cancelled() -> None:
    st = StoreThread()
    started, release = threading.Event(), threading.Event()
    done: list[str] = []
    after_call: list[bool] = []

    def slow() -> str:
        started.set()
        release.wait(5)
        done.append("committed")
        return "committed"

    async def caller(scope: anyio.CancelScope) -> None:
        with scope:
            await st.run(slow)
            after_call.append(True)  # the checkpoint after the call is where it is cancelled
            await anyio.lowlevel.checkpoint()
            after_call.append(False)

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(caller, scope)
        await anyio.to_thread.run_sync(started.wait, 5)
        scope.cancel()
        await anyio.sleep(0.05)
        assert done == []  # still waiting for the call: not abandoned
        release.set()
    assert done == ["committed"]
    assert after_call == [True]
    assert scope.cancelled_caught


async def test_a_cancelled_caller_queues_nothing() -> None:
    st = StoreThread()
    ran: list[int] = []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await st.run(lambda: ran.append(1))
    assert scope.cancelled_caught
    assert await st.run(lambda: len(ran)) == 0


async def test_the_call_sees_the_callers_context() -> None:
    st = StoreThread()
    token = who.set("turn-3")
    try:
        assert await st.run(who.get) == "turn-3"
    finally:
        who.reset(token)


async def test_the_call_is_queued_before_other_ready_tasks_run() -> None:
    """The other task blocks the loop until the call has started on the store's thread (a
    test-only block, for the order to be exact): with anyio's hop the call is handed over only
    after every ready task ran, so that wait would time out."""
    st = StoreThread()
    started = threading.Event()
    seen: list[bool] = []

    def block_until_started() -> None:
        seen.append(started.wait(2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(_ready_task, block_until_started)
        await st.run(started.set)
    assert seen == [True]


async def _ready_task(fn) -> None:  # noqa: ANN001 - a plain callable
    fn()


async def test_an_idle_thread_ends_and_the_next_call_starts_another(monkeypatch) -> None:
    monkeypatch.setattr(store_thread, "IDLE_S", 0.05)
    st = StoreThread("idle")
    assert await st.run(lambda: threading.current_thread().name) == "idle"
    with anyio.fail_after(5):
        while any(t.name == "idle" for t in threading.enumerate()):
            await anyio.sleep(0.02)
    assert await st.run(lambda: threading.current_thread().name) == "idle"  # a thread of its own again
