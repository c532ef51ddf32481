"""Unix-socket listener and byte stream on the event loop's own ``sock_*`` coroutines, and
the hand-off of a sandbox's TCP connection over that socket.

Why not anyio's ``create_unix_listener`` streams: on asyncio they wait for readiness with a
raw ``add_reader(fd, future.set_result)``; a cancellation that lands between the socket
becoming ready and that callback running makes the loop raise ``InvalidStateError`` (seen
here when a sandbox closed while its keep-alive connection ended). ``loop.sock_accept`` /
``sock_recv`` / ``sock_sendall`` handle that race (bpo-30064). The interface stays anyio's
``ByteStream``, so everything above this module is backend-neutral code.

A connection on a sandbox's socket either speaks HTTP itself or, from the sandbox's
``ca-modelgate``, carries the CLI's own TCP connection as a descriptor (``SCM_RIGHTS``) with
one byte, ``HANDOFF``: :func:`take_handoff` tells the two apart and returns the stream to
serve. The proxy then answers on the CLI's connection directly (no byte-copying hop in the
sandbox). A descriptor is used only if it is a connected TCP stream socket; anything else a
sandbox might send (a file, a pipe, a listening or unix socket, several descriptors) is
closed and the connection dropped.
"""

from __future__ import annotations

import array
import asyncio
import os
import socket
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
        self._pending = b""  # read already (while looking for a hand-off): the stream's first bytes

    @property
    def socket(self) -> socket.socket:
        return self._sock

    def unread(self, data: bytes) -> None:
        """``data`` comes first from the next ``receive`` (bytes read before the stream was known)."""
        self._pending = data + self._pending

    def _error(self, exc: OSError) -> Exception:
        return anyio.ClosedResourceError() if self._closed else anyio.BrokenResourceError()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        if self._closed:
            raise anyio.ClosedResourceError
        if self._pending:
            data, self._pending = self._pending[:max_bytes], self._pending[max_bytes:]
            return data
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

    @contextmanager
    def watch_close(self, gone: Callable[[], None]) -> Iterator[None]:
        """While inside, ``gone()`` is called (once, on the loop) if the peer closes its side or
        the connection breaks. Bytes it sends meanwhile are only peeked at, never read (they are
        its next request); after them the watch ends. A reader callback, not a task: no task,
        cancel scope or read per answer streamed (issue 12's benchmark)."""
        if self._closed or self._pending:
            yield
            return
        loop = asyncio.get_running_loop()
        fd = self._sock.fileno()

        def readable() -> None:
            try:
                data = self._sock.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            loop.remove_reader(fd)  # one verdict: bytes (the watch ends) or a close
            if not data:
                gone()

        loop.add_reader(fd, readable)
        try:
            yield
        finally:
            if not self._closed:
                loop.remove_reader(fd)

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


HANDOFF = b"F"  # the byte ca-modelgate sends with the CLI's connection
_MAX_FDS = 4  # room to see (and close) a few more than the one a hand-off carries


async def _readable(sock: socket.socket) -> None:
    """Wait until ``sock`` is readable (its own guarded future: see the module's note)."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    fd = sock.fileno()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _tcp_connection(fd: int) -> socket.socket | None:
    """The handed-off descriptor as a socket, if it is a connected TCP stream socket."""
    try:
        sock = socket.socket(fileno=fd)  # family and type come from the descriptor itself
    except OSError:  # ENOTSOCK: a file, a pipe…
        os.close(fd)
        return None
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET, socket.AF_INET6):
            raise OSError("not a TCP stream socket")
        sock.getpeername()  # ENOTCONN: a listening or unconnected socket
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE frames are small writes
    except OSError:
        sock.close()
        return None
    return sock


async def take_handoff(stream: SocketStream) -> SocketStream | None:
    """What to serve on a new connection of a sandbox's socket: the CLI's own TCP connection
    when one was handed over (``stream`` is closed then), else ``stream`` itself with its first
    bytes kept. None when the peer closed first or sent a descriptor that is not a connected
    TCP socket (the caller closes ``stream`` then, and bounds the wait)."""
    sock = stream.socket
    while True:
        await _readable(sock)
        try:
            data, ancdata, flags, _ = sock.recvmsg(len(HANDOFF), socket.CMSG_SPACE(_MAX_FDS * 4),
                                                   socket.MSG_CMSG_CLOEXEC)
            break
        except BlockingIOError:
            continue  # woken with nothing to read after all
        except OSError:
            return None
    fds = array.array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not fds:
        if not data:
            return None
        stream.unread(data)
        return stream
    await stream.aclose()  # the unix connection only carried the descriptor
    first, extra = fds[0], list(fds[1:])
    for fd in extra:
        os.close(fd)
    if data != HANDOFF or extra or flags & socket.MSG_CTRUNC:
        os.close(first)
        return None
    conn = _tcp_connection(first)
    return SocketStream(conn, stream.send_timeout_s) if conn is not None else None
