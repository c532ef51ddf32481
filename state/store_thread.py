"""The store's own thread: its blocking calls run there one at a time, in the order made.

Why not ``anyio.to_thread.run_sync``: it is a checkpoint before it hands the call over, so the
call waits behind every task ready on the loop at that moment, and its workers take calls from a
``queue.Queue`` (a condition variable). On this host that hop cost ~0.25 ms round trip idle and
0.17-0.37 ms before the call even began inside a turn, for each of a LIVE turn's three store
calls (tests/bench/bench_hops.py prints both hops side by side). Here the call is queued the
moment it is made and the answer comes back through the loop's own thread-safe wake-up.

The store serialises its calls anyway (one connection), so one thread is all it needs. The
thread ends after a while without calls and starts again with the next one; a store never
has to close it. asyncio only (the daemon's backend); other anyio backends take anyio's hop.
"""

from __future__ import annotations

import asyncio
import contextvars
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

T = TypeVar("T")

IDLE_S = 10.0  # as anyio's idle workers


class StoreThread:
    def __init__(self, name: str = "store") -> None:
        self._name = name
        self._calls: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any],
                                             contextvars.Context]] = queue.SimpleQueue()
        self._guard = threading.Lock()  # serving and the queue's emptiness change together
        self._serving = False

    async def run(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the store's thread. A cancellation point before it is queued; once queued
        it is seen through (as anyio's shielded hop): its effect on the store is never left
        unknown to the caller."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # another anyio backend
            return await anyio.to_thread.run_sync(fn)
        await checkpoint_if_cancelled()
        done: asyncio.Future[T] = loop.create_future()
        call = (fn, loop, done, contextvars.copy_context())
        with self._guard:
            self._calls.put(call)
            if not self._serving:
                self._serving = True
                threading.Thread(target=self._serve, name=self._name, daemon=True).start()
        with anyio.CancelScope(shield=True):
            return await done

    def _serve(self) -> None:
        while True:
            try:
                fn, loop, done, context = self._calls.get(timeout=IDLE_S)
            except queue.Empty:
                with self._guard:
                    if self._calls.empty():
                        self._serving = False
                        return
                continue
            try:
                outcome: tuple[bool, Any] = (True, context.run(fn))
            except BaseException as exc:  # noqa: BLE001 - the caller's to raise
                outcome = (False, exc)
            try:
                loop.call_soon_threadsafe(_answer, done, outcome)
            except RuntimeError:
                pass  # the loop is closed: nobody waits for the answer


def _answer(done: asyncio.Future[Any], outcome: tuple[bool, Any]) -> None:
    if done.cancelled():
        return  # the loop itself is shutting down (a shielded wait is not cancelled otherwise)
    ok, value = outcome
    if ok:
        done.set_result(value)
    else:
        done.set_exception(value)
