"""The event loop the daemon and the proxy service run on: uvloop (libuv) under anyio's
asyncio backend, not asyncio's own selector loop.

Why: a turn is mostly small socket reads and writes, wake-ups across threads (the store's) and
timers, which libuv does in C. With 16 concurrent chats the daemon took 13-19% less CPU a
turn on it, and the throughput of its turns rose by 15-20% (tests/bench/bench_supervisor.py
``--loop``, issue 16). Everything above this module stays backend-neutral anyio code; the
tests run on the same loop (tests/conftest.py's ``anyio_backend``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

T = TypeVar("T")

BACKEND = "asyncio"
BACKEND_OPTIONS: dict[str, Any] = {"use_uvloop": True}
UVICORN_LOOP = "uvloop"  # uvicorn.Config(loop=...) where uvicorn makes the loop itself


def run(func: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``anyio.run`` on the product's loop."""
    return anyio.run(func, *args, backend=BACKEND, backend_options=BACKEND_OPTIONS)
