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

import os
import socket
import struct

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


class SocketBytes:
    """A connected unix socket as a keeper byte stream (sandbox_manager.keeper_bytes.ByteStream), on
    anyio's socket stream as an exec's is (sandbox_manager.exec_stream): its close wakes a read
    or a send in flight (a retire closes the link under a turn that is reading it), ``b""``
    once the peer is gone, :class:`ExecStreamClosed` for a send that cannot be made."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream

    @classmethod
    async def of(cls, sock: socket.socket) -> SocketBytes:
        return cls(await anyio.abc.UNIXSocketStream.from_socket(sock))

    async def send_bytes(self, data: bytes) -> None:
        try:
            await self.stream.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ExecStreamClosed(f"the keeper's socket is gone: {exc!r}") from exc

    async def receive_bytes(self) -> bytes:
        try:
            return await self.stream.receive(65536)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            return b""

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()

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
