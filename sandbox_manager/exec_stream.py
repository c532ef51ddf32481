"""An attached ``docker exec`` as an async line stream (the drivers' transport in production).

The exec is created and started through the Docker SDK (``exec_start(socket=True)``), and
its hijacked unix socket is driven with anyio. No ``docker`` client process per resident
CLI (each would cost ~24 MiB on the host, protocols/baselines.md). With ``Tty=false`` the
engine multiplexes stdout and stderr on one socket in frames of
``[stream, 0, 0, 0, size:4 big-endian] payload``; stdout feeds the line reader and stderr
a bounded ring buffer kept for diagnostics.
"""

from __future__ import annotations

import socket
from collections import deque

import anyio
from anyio.abc import SocketStream

MAX_LINE_BYTES = 32 * 1024 * 1024
STDERR_KEEP = 16 * 1024


class ExecStreamClosed(Exception):
    """The exec's stream ended; what the CLI wrote last is in :meth:`ExecStream.diagnostics`."""


class ExecLineTooLong(ExecStreamClosed):
    """A stdout line exceeded :attr:`ExecStream.max_line`: the stream cannot be framed further."""


class ExecStream:
    """Lines over an attached exec. The runner adapts it to the drivers' transport contract
    (runner/transport.py); this module knows nothing of drivers."""

    def __init__(self, stream: SocketStream, exec_id: str, *, max_line: int = MAX_LINE_BYTES) -> None:
        self._stream = stream
        self.exec_id = exec_id
        self.max_line = max_line  # bound on one stdout line (memory, and a runaway CLI)
        self._broken = False
        self._raw = bytearray()  # undemultiplexed bytes
        self._stdout = bytearray()
        self._stderr: deque[bytes] = deque()
        self._stderr_len = 0
        self._eof = False
        self._closed_write = False
        self._closed = False
        self._send_lock = anyio.Lock(fast_acquire=True)

    @classmethod
    async def from_socket(cls, sock: socket.socket, exec_id: str) -> "ExecStream":
        from anyio.abc import UNIXSocketStream

        return cls(await UNIXSocketStream.from_socket(sock), exec_id)

    # -- Transport protocol --------------------------------------------------------------

    async def send(self, line: bytes) -> None:
        if self._closed_write or self._closed:
            raise ExecStreamClosed("stdin already closed")
        if not line.endswith(b"\n"):
            line += b"\n"
        async with self._send_lock:
            try:
                await self._stream.send(line)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise ExecStreamClosed(f"exec stdin is gone: {exc!r}") from exc

    async def receive(self) -> bytes | None:
        while True:
            idx = self._stdout.find(b"\n")
            if idx > self.max_line or (idx < 0 and len(self._stdout) > self.max_line):
                self._broken = True
                raise ExecLineTooLong(f"line longer than {self.max_line} bytes")
            if idx >= 0:
                line = bytes(self._stdout[:idx])
                del self._stdout[: idx + 1]
                return line[:-1] if line.endswith(b"\r") else line
            if self._eof:
                if self._stdout:
                    line = bytes(self._stdout)
                    self._stdout.clear()
                    return line
                return None
            try:
                chunk = await self._stream.receive(65536)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                self._eof = True
                continue
            self._raw += chunk
            self._demux()

    async def close(self) -> None:
        """Half-close: stdin EOF for the process; its output can still be read."""
        if self._closed_write or self._closed:
            return
        self._closed_write = True
        with anyio.CancelScope(shield=True):
            try:
                await self._stream.send_eof()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            await self._stream.aclose()

    @property
    def alive(self) -> bool:
        return not self._eof and not self._closed_write and not self._closed and not self._broken

    def diagnostics(self) -> str:
        return b"".join(self._stderr).decode(errors="replace")

    # -- raw bytes (byte protocols over the exec, e.g. the keeper's frames) ----------------

    async def send_raw(self, data: bytes) -> None:
        """Write ``data`` as is (no newline added)."""
        if self._closed_write or self._closed:
            raise ExecStreamClosed("stdin already closed")
        async with self._send_lock:
            try:
                await self._stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise ExecStreamClosed(f"exec stdin is gone: {exc!r}") from exc

    async def receive_raw(self) -> bytes:
        """The next demultiplexed stdout bytes as they arrive; ``b""`` at end of stream."""
        while not self._stdout:
            if self._eof:
                return b""
            try:
                chunk = await self._stream.receive(65536)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
                self._eof = True
                continue
            self._raw += chunk
            self._demux()
        data = bytes(self._stdout)
        self._stdout.clear()
        return data

    # -- framing ---------------------------------------------------------------------------

    def _demux(self) -> None:
        raw = self._raw
        while len(raw) >= 8:
            kind = raw[0]
            size = int.from_bytes(raw[4:8], "big")
            if len(raw) < 8 + size:
                break
            payload = bytes(raw[8: 8 + size])
            del raw[: 8 + size]
            if kind == 2:
                self._keep_stderr(payload)
            elif kind in (0, 1):
                self._stdout += payload

    def _keep_stderr(self, data: bytes) -> None:
        self._stderr.append(data)
        self._stderr_len += len(data)
        while self._stderr_len > STDERR_KEEP and len(self._stderr) > 1:
            self._stderr_len -= len(self._stderr.popleft())
