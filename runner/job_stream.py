"""One job's event stream, bounded (SPEC section 13).

The turn never waits for its reader: events are kept up to a byte budget, and once a
reader falls that far behind (or never reads) every later event is dropped and counted.
The stream then ends with a ``cut`` line saying how many were dropped, followed by the
line the job ends with (the receipt), which is always delivered: a slow or absent reader
costs the daemon at most the budget plus that one line, the turn still settles and its
receipt is stored and fetchable by job id.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
from pydantic import BaseModel, Field


class CutEvent(BaseModel):
    """The stream was cut: ``dropped`` events after the reader fell ``budget_bytes`` behind
    are missing. The receipt line still follows; ``GET /v1/jobs/{job_id}`` also has it."""

    type: Literal["cut"] = "cut"
    reason: Literal["slow_reader"] = "slow_reader"
    dropped: int = Field(ge=1)
    budget_bytes: int


def ndjson_line(obj: dict[str, Any]) -> bytes:
    return (json.dumps(obj, ensure_ascii=False) + "\n").encode()


class JobStream:
    """Single producer (the job), single consumer (the HTTP response or a library caller)."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self.dropped = 0
        self._lines: deque[bytes] = deque()
        self._bytes = 0
        self._finished = False
        self._gone = False
        self._wake = anyio.Event()

    @property
    def buffered_bytes(self) -> int:
        return self._bytes

    @property
    def drained(self) -> bool:
        """The stream has ended and its reader has taken every line (or left)."""
        return self._finished and not self._lines

    def emit(self, event: dict[str, Any]) -> None:
        """Never blocks. After the first drop nothing more is kept: the reader sees a cut,
        not a stream with silent holes in it."""
        if self._gone or self._finished:
            return
        line = ndjson_line(event)
        if self.dropped or self._bytes + len(line) > self.budget_bytes:
            self.dropped += 1
            return
        self._lines.append(line)
        self._bytes += len(line)
        self._wake.set()

    def finish(self, last: dict[str, Any]) -> None:
        """End the stream with ``last`` (after a cut line when events were dropped)."""
        if self._finished:
            return
        self._finished = True
        if self._gone:
            return
        tail = [ndjson_line(last)]
        if self.dropped:
            tail.insert(0, ndjson_line(CutEvent(dropped=self.dropped, budget_bytes=self.budget_bytes).model_dump()))
        for line in tail:
            self._lines.append(line)
            self._bytes += len(line)
        self._wake.set()

    def close(self) -> None:
        """The reader left: drop what is buffered; the job goes on."""
        self._gone = True
        self._lines.clear()
        self._bytes = 0

    async def lines(self) -> AsyncIterator[bytes]:
        try:
            while True:
                while self._lines:
                    line = self._lines.popleft()
                    self._bytes -= len(line)
                    yield line
                if self._finished:
                    return
                await self._wake.wait()
                self._wake = anyio.Event()
        finally:
            self.close()

    async def chunks(self) -> AsyncIterator[bytes]:
        """Whole lines, but what queued up while the reader was away comes as one chunk: the
        HTTP response writes a burst of deltas once, not once a line."""
        batch: list[bytes] = []
        lines = self.lines()
        try:
            while True:
                try:
                    batch.append(await lines.__anext__())
                except StopAsyncIteration:
                    break
                if self._lines:  # more are queued already: take them without waiting
                    continue
                yield b"".join(batch)
                batch.clear()
            if batch:
                yield b"".join(batch)
        finally:
            await lines.aclose()

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        async for line in self.lines():
            yield json.loads(line)
