"""The daemon's link to a keeper straight through the keeper's socket, where the host reaches it.

A keeper's first client is the attached exec that started it (``ca-keeper run``), and a
re-attach was another attached exec (``ca-keeper attach``): in both, the exec's process relays
bytes between its stdio and the keeper's socket. A line to the CLI and its answer then crossed
the engine, the container's shim and that relay, each way. The host can reach the socket
itself, through the container's init (``/proc/<pid>/root/<path>``), as memory readings read
pidfiles (sandbox_manager.proc_memory). tests/bench/bench_keeper.py, a 227-byte line's round
trip through the keeper: 0.51-0.61 ms over the relay, 0.23-0.25 ms direct (a plain attached exec
of the same echo CLI: 0.27-0.29 ms).

The path is inside the sandbox, so the sandbox decides what it names: a symlink there turns the
host's connect towards anything the host can reach (another sandbox's keeper, the engine's own
socket). Before a byte is sent the peer (``SO_PEERCRED``) must be a process of the container's
own pid namespace; then the keeper's hello must carry the expected identity
(``KeeperChannel.open``'s ``expect``). Where the link cannot be made this way (no socket there, a
peer outside the sandbox, a host that cannot read ``/proc/<pid>/root``: another user, a remote
engine), :func:`link_direct` returns ``None`` and the caller keeps the attached exec.
"""

from __future__ import annotations

import asyncio
import os
import socket
import struct
from typing import cast

import anyio
import anyio.abc
import structlog

from sandbox_manager.exec_stream import ExecStreamClosed
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_errors import KeeperUnavailable
from sandbox_manager.keeper_identity import KeeperIdentity

log = structlog.get_logger("keeper_link")

CONNECT_TIMEOUT_S = 2.0
_CREDS = struct.Struct("3i")  # struct ucred: pid, uid, gid


class NoDirectLink(Exception):
    """The host cannot link to this keeper itself; the message says why."""


HIGH_WATER = 1 << 20  # bytes read and not yet taken: the socket is not read further meanwhile


class _Link(asyncio.Protocol):
    """The socket's side on the event loop: it stays registered with the loop for the link's
    life, and what arrives is kept until :meth:`SocketBytes.receive_bytes` takes it."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.chunks: list[bytes] = []
        self.buffered = 0
        self.ended = False  # the peer closed, or the connection was lost or closed here
        self.paused_writing = False
        self.reading_paused = False
        self._reader: asyncio.Future[None] | None = None
        self._writers: list[asyncio.Future[None]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.chunks.append(data)
        self.buffered += len(data)
        if self.buffered > HIGH_WATER and not self.reading_paused and self.transport is not None:
            self.transport.pause_reading()
            self.reading_paused = True
        self._wake_reader()

    def eof_received(self) -> bool:
        self.ended = True
        self._wake_reader()
        return False  # the transport closes itself

    def connection_lost(self, exc: Exception | None) -> None:
        self.ended = True
        self.paused_writing = False
        self._wake_reader()
        self._wake_writers()

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        self._wake_writers()

    @property
    def reading(self) -> bool:
        return self._reader is not None

    async def readable(self) -> None:
        self._reader = asyncio.get_running_loop().create_future()
        try:
            await self._reader
        finally:
            self._reader = None

    async def writable(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._writers.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._writers:
                self._writers.remove(waiter)

    def _wake_reader(self) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.set_result(None)

    def _wake_writers(self) -> None:
        for waiter in self._writers:
            if not waiter.done():
                waiter.set_result(None)
        self._writers.clear()


class SocketBytes:
    """A connected unix socket as a keeper byte stream (sandbox_manager.keeper_bytes.ByteStream),
    as a transport of the event loop's own: its close wakes a read or a send in flight (a retire
    closes the link under a turn that is reading it), ``b""`` once the peer is gone,
    :class:`ExecStreamClosed` for a send that cannot be made.

    Why not anyio's socket stream (as an exec's is, sandbox_manager.exec_stream): each of its
    reads and sends is a checkpoint (one more pass of the loop), and a read that finds nothing
    adds the socket to the loop's poll and takes it out again once it is ready. A turn's lines
    from the CLI come one read each: tests/bench/bench_link_stream.py measures both side by
    side. Here the socket is registered once, and a read takes everything that arrived."""

    def __init__(self, link: _Link) -> None:
        self._link = link
        self._closed = False

    @classmethod
    async def of(cls, sock: socket.socket) -> SocketBytes:
        _, link = await asyncio.get_running_loop().create_unix_connection(_Link, sock=sock)
        return cls(link)

    async def send_bytes(self, data: bytes) -> None:
        link = self._link
        transport = link.transport
        if self._closed or link.ended or transport is None or transport.is_closing():
            raise ExecStreamClosed("the keeper's socket is gone")
        transport.write(data)  # at once when the socket has room; the rest as it drains
        if not link.paused_writing:
            return
        while link.paused_writing and not self._closed and not link.ended:
            await link.writable()  # a peer that stopped reading: as anyio's send, until it reads
        if self._closed or link.ended:
            raise ExecStreamClosed("the keeper's socket closed before it took the bytes")

    async def receive_bytes(self) -> bytes:
        link = self._link
        if link.reading:
            # One reader at a time, as anyio's stream: a second one (a retire's wait for the CLI's
            # exit beside the turn's read) is refused, and the first keeps its wake-up
            raise anyio.BusyResourceError("reading from")
        while not link.chunks or self._closed:
            if self._closed or link.ended:
                return b""  # closed here: what was read and not taken is not wanted any more
            await link.readable()
        data = link.chunks[0] if len(link.chunks) == 1 else b"".join(link.chunks)
        link.chunks.clear()
        link.buffered = 0
        if link.reading_paused and link.transport is not None and not link.ended:
            link.reading_paused = False
            link.transport.resume_reading()
        return data

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        link = self._link
        if link.transport is not None:
            link.transport.abort()  # as a socket's close: what was not sent is not sent
        link._wake_reader()
        link._wake_writers()

    def diagnostics(self) -> str:
        return ""


def connect_in_sandbox(init_pid: int, path: str, *, proc: str = "/proc") -> socket.socket:
    """The keeper's socket at ``path`` in the sandbox whose init has host pid ``init_pid``,
    connected and served from inside that sandbox, or :class:`NoDirectLink`. Blocking (a
    connect and reads of /proc): call it in a worker thread."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(CONNECT_TIMEOUT_S)
        try:
            sock.connect(f"{proc}/{init_pid}/root/{path.lstrip('/')}")
            peer, _, _ = _CREDS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDS.size))
            served_from, sandbox = _pid_namespace(proc, peer), _pid_namespace(proc, init_pid)
        except OSError as exc:
            raise NoDirectLink(f"{path}: {exc.strerror or exc!r}") from None
        if served_from != sandbox:
            raise NoDirectLink(f"{path} is served by pid {peer} outside the sandbox's pid namespace")
        sock.setblocking(False)
        return sock
    except BaseException:
        sock.close()
        raise


def _pid_namespace(proc: str, pid: int) -> tuple[int, int]:
    st = os.stat(f"{proc}/{pid}/ns/pid")
    return st.st_dev, st.st_ino


async def link_direct(init_pid: int | None, socket_path: str, *, expect: KeeperIdentity, from_offset: int,
                      timeout_s: float = 30.0, auto_ack_bytes: int | None = None) -> KeeperChannel | None:
    """Attach to the keeper through its socket from the host; ``None`` where the host cannot
    (the caller attaches through an exec). A keeper that answered is the attach's answer
    (``KeeperIdentityMismatch`` for another keeper, a refusal for a bad offset), as an exec's
    attach to the same path would raise it; one that closed before its hello (a keeper ending
    as its CLI failed to start) is ``None`` too: the caller's own link says what happened."""
    if init_pid is None:
        return None
    try:
        sock = await anyio.to_thread.run_sync(connect_in_sandbox, init_pid, socket_path)
        return await KeeperChannel.open(await SocketBytes.of(sock), from_offset=from_offset, expect=expect,
                                        timeout_s=timeout_s, auto_ack_bytes=auto_ack_bytes)
    except (NoDirectLink, KeeperUnavailable) as exc:
        log.info("keeper.no_direct_link", detail=str(exc))
        return None
