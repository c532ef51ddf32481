"""Independent engine calls made at once, judged one by one in a fixed order (issue 16).

A turn that checks a recorded sandbox against the engine (a RESTORED turn, any turn that
launches a CLI) reads four things that depend on nothing but the record: the data root's
marker volume, the image, the chat's volume and its container. One after the other they
were four round trips to the engine before the start (~3 ms here). A read decides nothing
by itself, so they are made together; the caller then judges them in the order it always
has, and the first check that fails names the reason, whatever failed in the reads after it.
A new sandbox's start and its record's commit go side by side the same way
(sandbox_manager.creation): each error is raised as itself, not wrapped in a group.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio


@dataclass
class Read:
    """One read's answer: its value, or the error it raised (raised again by :meth:`get`)."""

    value: Any = None
    error: Exception | None = None

    def get(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


async def read_at_once(*reads: Callable[[], Awaitable[Any]] | None) -> list[Read]:
    """Each read's answer, in the order given (``None``: nothing to read, a ``Read`` of None).
    Cancellation is not an answer: it cancels every read and propagates."""
    answers = [Read() for _ in reads]

    async def one(read: Callable[[], Awaitable[Any]], answer: Read) -> None:
        try:
            answer.value = await read()
        except Exception as exc:  # noqa: BLE001 - kept for the judge, raised there in its turn
            answer.error = exc

    async with anyio.create_task_group() as tg:
        for read, answer in zip(reads, answers, strict=True):
            if read is not None:
                tg.start_soon(one, read, answer)
    return answers
