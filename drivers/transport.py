"""The byte-stream seam between a driver and a CLI process.

A driver never knows where its CLI runs. It talks to a :class:`Transport`: async,
line-oriented send / receive / close / alive. The same driver therefore runs against a
local subprocess in tests (``tests/support/local_process.py``) and against a ``docker exec``
attached socket in production (supplied by the runner from ``sandbox_manager``), just as
httpx clients run over any transport.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

MAX_LINE_BYTES = 32 * 1024 * 1024  # Codex/Claude events can be large; a runaway line is an error


class TransportClosed(Exception):
    """The stream ended (EOF or a dead process). Never settlement."""


class LineTooLong(TransportClosed):
    pass


@runtime_checkable
class Transport(Protocol):
    async def send(self, line: bytes) -> None:
        """Write one line; a trailing newline is added when missing."""

    async def receive(self) -> bytes | None:
        """The next line without its newline, or None at end of stream."""

    async def close(self) -> None:
        """Close our side (stdin EOF); idempotent."""

    @property
    def alive(self) -> bool:
        """True while the stream can still carry lines both ways."""

    def diagnostics(self) -> str:
        """Recent stderr of the process, for error details (never parsed for protocol)."""


class TransportWrapper:
    """A :class:`Transport` that hands every call to ``inner``; subclasses observe lines by
    overriding :meth:`send` / :meth:`receive` (recording, timing, rewriting)."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner

    async def send(self, line: bytes) -> None:
        await self.inner.send(line)

    async def receive(self) -> bytes | None:
        return await self.inner.receive()

    async def close(self) -> None:
        await self.inner.close()

    @property
    def alive(self) -> bool:
        return self.inner.alive

    def diagnostics(self) -> str:
        return self.inner.diagnostics()


def unwrap(transport: Transport) -> Transport:
    """The innermost transport under any :class:`TransportWrapper` layers."""
    while isinstance(transport, TransportWrapper):
        transport = transport.inner
    return transport


class LineBuffer:
    """Splits an incoming byte stream into lines (LF only; U+2028 is not a line break)."""

    def __init__(self, max_line: int = MAX_LINE_BYTES) -> None:
        self._buf = bytearray()
        self._max = max_line

    def feed(self, data: bytes) -> None:
        self._buf += data

    def pop_line(self) -> bytes | None:
        idx = self._buf.find(b"\n")
        if idx < 0:
            if len(self._buf) > self._max:
                raise LineTooLong(f"line longer than {self._max} bytes")
            return None
        line = bytes(self._buf[:idx])
        del self._buf[: idx + 1]
        if line.endswith(b"\r"):
            line = line[:-1]
        return line

    def rest(self) -> bytes | None:
        if not self._buf:
            return None
        line = bytes(self._buf)
        self._buf.clear()
        return line
