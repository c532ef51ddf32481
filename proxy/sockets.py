"""Unix-socket listener and byte stream on the event loop's own ``sock_*`` coroutines.

Why not anyio's ``create_unix_listener`` streams: on asyncio they wait for readiness with a
raw ``add_reader(fd, future.set_result)``; a cancellation that lands between the socket
becoming ready and that callback running makes the loop raise ``InvalidStateError`` (seen
here when a sandbox closed while its keep-alive connection ended). ``loop.sock_accept`` /
``sock_recv`` / ``sock_sendall`` handle that race (bpo-30064). The interface stays anyio's
``ByteStream``, so everything above this module is backend-neutral code.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
from pathlib import Path

import anyio
from anyio.abc import ByteStream


class SocketStream(ByteStream):
    """A connected socket. ``send`` writes at once when the socket has room (the common case:
    no timer, no loop round-trip per SSE frame) and only waits, at most ``send_timeout_s``,
    for a peer that stopped reading."""

    def __init__(self, sock: socket.socket, send_timeout_s: float = 120.0) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._closed = False
        self.send_timeout_s = send_timeout_s

    def _error(self, exc: OSError) -> Exception:
        return anyio.ClosedResourceError() if self._closed else anyio.BrokenResourceError()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            data = await asyncio.get_running_loop().sock_recv(self._sock, max_bytes)
        except OSError as exc:
            raise self._error(exc) from exc
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        try:
            sent = self._sock.send(item)
        except BlockingIOError:
            sent = 0
        except OSError as exc:
            raise self._error(exc) from exc
        if sent == len(item):
            return
        try:
            with anyio.fail_after(self.send_timeout_s):
                await asyncio.get_running_loop().sock_sendall(self._sock, memoryview(item)[sent:])
        except OSError as exc:
            raise self._error(exc) from exc

    async def send_eof(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()
        await anyio.lowlevel.checkpoint()


class UnixListener:
    """A listening unix socket at ``path`` (a stale socket file there is replaced).
    Construct it off the event loop: it touches the file system."""

    def __init__(self, path: Path, mode: int, backlog: int = 128) -> None:
        self.path = path
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                if not stat.S_ISSOCK(path.lstat().st_mode):
                    raise FileExistsError(f"{path} exists and is not a socket")
                path.unlink()  # stale: left by an earlier process
            except FileNotFoundError:
                pass
            sock.bind(str(path))
            os.chmod(path, mode)
            sock.listen(backlog)
            sock.setblocking(False)
        except BaseException:
            sock.close()
            raise
        self._sock = sock

    async def accept(self, send_timeout_s: float = 120.0) -> SocketStream:
        conn, _ = await asyncio.get_running_loop().sock_accept(self._sock)
        return SocketStream(conn, send_timeout_s)

    def close(self) -> None:
        self._sock.close()


async def connect_unix(path: Path, send_timeout_s: float = 120.0) -> SocketStream:
    """A stream connected to the listening unix socket at ``path`` (``OSError`` when nothing
    listens there: ``FileNotFoundError``, ``ConnectionRefusedError``)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, str(path))
    except BaseException:
        sock.close()
        raise
    return SocketStream(sock, send_timeout_s)
