"""The byte-stream seam between a driver and a CLI process, and its contract.

A driver never knows where its CLI runs. It talks to a :class:`Transport`: async,
line-oriented send / receive / close / alive. The same driver therefore runs against a
local subprocess in tests (``tests/support/local_process.py``), recorded replays
(``tests/support/``) and a ``docker exec`` attached socket in production, just as httpx
clients run over any transport.

The contract every transport keeps (checked by tests/unit/test_transport_conformance.py
against each of them):

* ``receive()`` returns the next line without its newline (CR of a CRLF trimmed); at end of
  stream it returns the unterminated tail, if any, as a last line, then ``None`` — every later
  call ``None`` again — and ``alive`` is false from then on.
* A line longer than the transport's bound raises :class:`LineTooLong`; the stream is then
  dead (``alive`` false).
* ``close()`` half-closes (stdin EOF), is idempotent and never raises; afterwards ``send()``
  raises :class:`TransportClosed`, while ``receive()`` still drains what the process prints.
* A ``receive()`` cancelled by a cancel scope loses no bytes: the next call continues the line.
* ``send``/``receive`` raise nothing but :class:`TransportError` subclasses (and
  cancellation); drivers map that family once (``drivers/session.py``) to
  ``NotSettled(transport_closed)`` or a failed handshake.

The production stream lives in ``sandbox_manager`` (Docker only), which must not import the
drivers. So the error family is conformed to by an **adapter on the runner side**:
``runner/transport.py`` wraps an ``ExecStream`` and re-raises its ``ExecStreamClosed`` /
``ExecLineTooLong`` as :class:`TransportClosed` / :class:`LineTooLong` (a neutral errors module
both packages import would be a new layer below both, for two exception classes; the adapter
keeps sandbox_manager free of driver concepts and is where the runner already joins the two).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

MAX_LINE_BYTES = 32 * 1024 * 1024  # Codex/Claude events can be large; a runaway line is an error


class TransportError(Exception):
    """The family every transport raises from ``send``/``receive`` (nothing else escapes)."""


class TransportClosed(TransportError):
    """The stream ended (EOF on write, a dead process, our own close). Never settlement."""


class LineTooLong(TransportClosed):
    """A line exceeded the transport's bound: the stream cannot be framed any further."""


@runtime_checkable
class Transport(Protocol):
    async def send(self, line: bytes) -> None:
        """Write one line; a trailing newline is added when missing. After ``close()`` or once
        the process is gone: :class:`TransportClosed`."""

    async def receive(self) -> bytes | None:
        """The next line without its newline, or None at end of stream (see the module contract)."""

    async def close(self) -> None:
        """Close our side (stdin EOF); idempotent, never raises; output can still be read."""

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
        if idx > self._max or (idx < 0 and len(self._buf) > self._max):
            raise LineTooLong(f"line longer than {self._max} bytes")
        if idx < 0:
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
