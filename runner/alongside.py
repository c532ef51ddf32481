"""Two round trips at once: a side update runs while the turn's own call is awaited.

The turn path has pairs of independent waits — the proxy learning whom a member's requests
belong to while the store reads or commits — that cost the sum of their latencies one after
the other. ``alongside`` costs their maximum, and keeps the main call's error as itself (a
task group would wrap it in an ``ExceptionGroup``, and callers catch ``Fenced``,
``StoreUnavailable`` and friends by type).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TypeVar

import anyio

T = TypeVar("T")


async def alongside(side: Callable[[], Awaitable[None]], main: Callable[[], Awaitable[T]]) -> T:
    """``main()``'s result once both are done. ``side`` must not raise (an update the proxy may
    miss is replayed on its next connection); a failing ``main`` cancels it."""
    failure: Exception | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(side)
        try:
            # ``side`` takes its first step now, up to its first wait (its request sent), rather
            # than whenever ``main`` first waits: the turn's preparation runs a millisecond
            # without one, and the proxy's begin went out after it (issue 16's trace)
            await anyio.lowlevel.checkpoint()
            result = await main()
        except Exception as exc:  # raised below as itself
            failure = exc
            tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result
