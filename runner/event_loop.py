"""The event loop the daemon and the proxy service run on: uvloop (libuv) under anyio's
asyncio backend, not asyncio's own selector loop.

Why: a turn is mostly small socket reads and writes, wake-ups across threads (the store's) and
timers, which libuv does in C. Measured with tests/bench/bench_supervisor.py ``--loop`` (issue
16; Pi, 16 concurrent chats x 8 rounds, four runs each way, alternated): the daemon's turns/s
64.3 -> 69.9 (means), its process's CPU a turn 7.8 -> 6.5 ms (medians; one uvloop run of
the four read 9.1), and the bare arm's drivers 2.6 -> 2.0 ms. With Codex (two runs each) no
difference stood out of Codex's own variance. Everything above this module stays
backend-neutral anyio code; the tests run on the same loop (tests/conftest.py's ``anyio_backend``).
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
