"""The model proxy host: one listening unix socket per sandbox, one task group for them all.

    async with ProxyHost(ProxyConfig.from_env(), sink=store, turn_of=runner.running_job) as proxy:
        path = await proxy.open_sandbox(chat_key, socket_dir, user_id=user_id)
        ...                     # bind-mount socket_dir read-only into the sandbox
        await proxy.flush(chat_key)   # before a verdict: records of finished exchanges are in the sink
        await proxy.close_sandbox(chat_key)

The chat is the socket: each sandbox's listener knows its ``chat_key``, and nothing a
sandbox sends can name another. Each sandbox has its own task group and connection limit,
so a sandbox that floods, stalls or sends garbage only ever costs its own connections.
Re-opening a chat at the same directory (a daemon restart) replaces a stale socket file in
place: the directory is what is mounted, so the sandbox sees the new socket at once.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import anyio
import structlog
from anyio.abc import TaskGroup

from .audit_memo import AuditMemo
from .config import ProxyConfig
from .exchange import Exchange, ProxyContext, Rewrite, TurnLookup
from .http1 import ClientConnection
from .keys import KeySource
from .metrics import ProxyMetrics
from .records import WireRecord, WireSink
from .sockets import SocketStream, UnixListener, take_handoff
from .upstream import Connector, Timeouts, Upstream

log = structlog.get_logger("proxy")

SOCKET_NAME = "model.sock"


@dataclass
class _Sandbox:
    chat_key: str
    user_id: str
    directory: Path
    path: Path
    listener: UnixListener
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    stopped: anyio.Event = field(default_factory=anyio.Event)
    connections: int = 0
    busy: int = 0  # exchanges from request head to record in the sink
    idle: anyio.Event = field(default_factory=anyio.Event)

    def enter(self) -> None:
        if self.busy == 0:
            self.idle = anyio.Event()
        self.busy += 1

    def leave(self) -> None:
        self.busy -= 1
        if self.busy == 0:
            self.idle.set()


class ProxyHost:
    def __init__(self, config: ProxyConfig, *, sink: WireSink | None = None, turn_of: TurnLookup | None = None,
                 keys: KeySource | None = None, metrics: ProxyMetrics | None = None,
                 connector: Connector | None = None, rewrite: Rewrite | None = None) -> None:
        self.config = config
        self.metrics = metrics or ProxyMetrics()
        self._keys = keys or config.key_source()
        self._sink, self._turn_of, self._connector = sink, turn_of, connector
        self._rewrite = rewrite  # test seam only (see exchange.Rewrite)
        self._sandboxes: dict[str, _Sandbox] = {}
        self._tg: TaskGroup | None = None
        self._ctx: ProxyContext | None = None
        self._upstream: Upstream | None = None
        self._opening = anyio.Lock()  # one open/close at a time: two binds of one path must not race

    # ---------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> ProxyHost:
        cfg = self.config
        self._upstream = Upstream(cfg.upstream_url, connector=self._connector, timeouts=Timeouts(
            connect_s=cfg.upstream_connect_timeout_s, read_s=cfg.upstream_read_timeout_s,
            write_s=cfg.upstream_write_timeout_s))
        self._ctx = ProxyContext(upstream=self._upstream, keys=self._keys, metrics=self.metrics, sink=self._sink,
                                 turn_of=self._turn_of, capture=cfg.capture, rewrite=self._rewrite,
                                 audit_memo=AuditMemo())
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        with anyio.CancelScope(shield=True):
            for chat_key in list(self._sandboxes):
                await self.close_sandbox(chat_key)
        assert self._tg is not None and self._upstream is not None
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(exc_type, exc, tb)
        await self._upstream.aclose()
        self._tg = None

    # ---------------------------------------------------------------- sandboxes

    @staticmethod
    def socket_path(directory: Path) -> Path:
        return Path(directory) / SOCKET_NAME

    def is_open(self, chat_key: str) -> bool:
        return chat_key in self._sandboxes

    def open_sandboxes(self) -> int:
        return len(self._sandboxes)

    def in_flight(self) -> int:
        """Exchanges of every sandbox between request head and record in the sink."""
        return sum(sb.busy for sb in self._sandboxes.values())

    async def open_sandbox(self, chat_key: str, directory: Path, *, user_id: str) -> Path:
        """Listen on ``directory/model.sock`` for ``chat_key``; returns the socket path.
        Idempotent for the same directory; a stale socket file left by an earlier process
        is replaced at the same path."""
        async with self._opening:
            return await self._open(chat_key, Path(directory), user_id)

    async def _open(self, chat_key: str, directory: Path, user_id: str) -> Path:
        if self._tg is None:
            raise RuntimeError("ProxyHost is not running (use `async with`)")
        existing = self._sandboxes.get(chat_key)
        if existing is not None:
            if existing.directory != directory:
                raise ValueError(f"chat_key: {chat_key!r} already has a model socket in {existing.directory}")
            return existing.path
        path = self.socket_path(directory)
        listener = await anyio.to_thread.run_sync(self._listen_blocking, path)
        sb = _Sandbox(chat_key, user_id, directory, path, listener)
        sb.idle.set()
        self._sandboxes[chat_key] = sb
        self._tg.start_soon(self._serve, sb)
        log.info("proxy.sandbox_opened", chat_key=chat_key, socket=str(path))
        return path

    def _listen_blocking(self, path: Path) -> UnixListener:
        path.parent.mkdir(parents=True, exist_ok=True)
        os.chmod(path.parent, 0o755)  # the sandbox's uid must reach the socket through the mount
        # root gives the socket to the sandbox's uid; a non-root daemon cannot, so anyone may
        # connect (the per-sandbox directory is still mounted into its own sandbox only)
        root = os.geteuid() == 0
        listener = UnixListener(path, 0o660 if root else 0o666)
        if root:
            try:
                os.chown(path, self.config.socket_uid, self.config.socket_gid)
            except BaseException:
                listener.close()
                raise
        return listener

    async def close_sandbox(self, chat_key: str) -> None:
        """Stop listening, end the sandbox's connections, remove its socket file."""
        with anyio.CancelScope(shield=True):
            async with self._opening:
                sb = self._sandboxes.pop(chat_key, None)
                if sb is None:
                    return
                sb.scope.cancel()
                await sb.stopped.wait()
                if self._ctx is not None and self._ctx.audit_memo is not None:  # its texts leave memory with it
                    self._ctx.audit_memo.forget_chat(chat_key)
                await anyio.to_thread.run_sync(_unlink_socket, sb.path)
        log.info("proxy.sandbox_closed", chat_key=chat_key)

    async def flush(self, chat_key: str, timeout_s: float = 10.0) -> None:
        """Wait (at most ``timeout_s``) until no exchange of ``chat_key`` is in flight: every
        request that reached the proxy has its record in the sink. Call before a verdict."""
        if self.quiet(chat_key):
            return  # without a trip round the event loop: the usual case as a turn settles
        sb = self._sandboxes[chat_key]
        with anyio.move_on_after(timeout_s):
            await sb.idle.wait()

    def quiet(self, chat_key: str) -> bool:
        """No exchange of ``chat_key`` is in flight now (a flush would return at once)."""
        sb = self._sandboxes.get(chat_key)
        return sb is None or sb.busy == 0

    # ---------------------------------------------------------------- serving

    async def _serve(self, sb: _Sandbox) -> None:
        try:
            with sb.scope:
                async with anyio.create_task_group() as tg:
                    while True:
                        try:
                            stream = await sb.listener.accept(self.config.write_timeout_s)
                        except OSError as exc:  # EMFILE and friends: back off, keep the socket
                            log.warning("proxy.accept_failed", chat_key=sb.chat_key, error=str(exc))
                            await anyio.sleep(0.1)
                            continue
                        tg.start_soon(self._connection, sb, stream)
        except Exception:
            log.exception("proxy.sandbox_failed", chat_key=sb.chat_key)
        finally:
            sb.listener.close()
            sb.stopped.set()

    async def _connection(self, sb: _Sandbox, stream: SocketStream) -> None:
        assert self._ctx is not None
        limits = self.config.limits()
        conn: ClientConnection | None = None
        sb.connections += 1
        try:
            served: SocketStream | None = None
            # the CLI's own connection, handed over by the sandbox's gate (or this one's HTTP)
            with anyio.move_on_after(limits.idle_timeout_s):
                served = await take_handoff(stream)
            if served is None:
                return
            conn = ClientConnection(served, limits)
            if sb.connections > self.config.max_connections_per_sandbox:
                self.metrics.rejected.labels(reason="too_many_connections").inc()
                await conn.answer_and_close(503, "too_many_connections",
                                            f"more than {self.config.max_connections_per_sandbox} "
                                            "concurrent connections from this sandbox")
                return
            while True:
                req = await conn.next_request()
                if req is None:
                    self._count_bad_input(conn)
                    return
                sb.enter()
                try:
                    keep, record = await Exchange(self._ctx, conn, sb.chat_key, sb.user_id).run(req)
                    await self._put(sb, record)
                finally:
                    sb.leave()
                if not keep or not conn.reusable():
                    return
                conn.next_cycle()
        except Exception:
            log.exception("proxy.connection_failed", chat_key=sb.chat_key)
        finally:
            sb.connections -= 1
            if conn is not None:
                await conn.close()
            with anyio.CancelScope(shield=True):
                await stream.aclose()

    def _count_bad_input(self, conn: ClientConnection) -> None:
        if conn.answered_error is not None:
            self.metrics.rejected.labels(reason=conn.answered_error).inc()

    async def _put(self, sb: _Sandbox, record: WireRecord) -> None:
        log.info("proxy.request", chat_key=record.chat_key, member_key=record.member_key, job_id=record.job_id,
                 route=record.route, method=record.method, path=record.path, status=record.status, kind=record.kind,
                 bytes_in=record.bytes_in, bytes_out=record.bytes_out, ms=record.duration_ms, error=record.error,
                 upstream_request_id=record.upstream_request_id)
        if self._sink is None:
            return
        try:
            with anyio.CancelScope(shield=True):
                await self._sink.put(record)
        except Exception:
            log.exception("proxy.sink_failed", chat_key=sb.chat_key, seq=record.seq)


def _unlink_socket(path: Path) -> None:
    try:
        if stat.S_ISSOCK(path.lstat().st_mode):
            path.unlink()
    except FileNotFoundError:
        pass
