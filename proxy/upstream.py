"""The proxy's way to the model gateway: a small keep-alive HTTP/1.1 client (llhttp via
:mod:`proxy.framing`, over anyio).

Why not httpx here (the team's default client): measured with tests/bench/bench_proxy.py,
httpx + httpcore were three quarters of the proxy's CPU per streamed request (request and
response models, header re-validation, a cancel scope around every socket operation), which
alone broke the ≤ 2 ms budget. This client does only what a pass-through needs: raw headers
in and out, the request in one write, the body as the parser yields it, one idle deadline per
read loop, and connections kept per origin.

``Connector`` is the transport seam (TCP/TLS by default; tests may dial anything); ``Upstream``
is the client on top of it.
"""

from __future__ import annotations

import select
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import anyio
from anyio.abc import ByteStream, SocketAttribute

from .framing import END, NEED_DATA, Head, Parser, ProtocolError, request_bytes

RECEIVE_SIZE = 64 * 1024
Connector = Callable[[], Awaitable[ByteStream]]


class UpstreamError(Exception):
    """The gateway could not be used; ``reason`` is a metric label, the message is safe to show."""

    reason = "upstream_error"


class UpstreamUnreachable(UpstreamError):
    reason = "upstream_unreachable"


class UpstreamTimeout(UpstreamError):
    reason = "upstream_timeout"


class UpstreamBrokeOff(UpstreamError):
    reason = "upstream_broke_off"


@dataclass(frozen=True)
class Timeouts:
    connect_s: float = 10.0
    read_s: float = 900.0  # silence allowed between two reads (a model may think for minutes)
    write_s: float = 60.0
    keepalive_s: float = 30.0  # idle connections older than this are not reused


def tcp_connector(host: str, port: int, *, tls: bool, timeout_s: float,
                  tls_context: ssl.SSLContext | None = None) -> Connector:
    context = (tls_context or ssl.create_default_context()) if tls else None

    async def connect() -> ByteStream:
        try:
            with anyio.fail_after(timeout_s):
                stream = await anyio.connect_tcp(host, port, tls=tls, ssl_context=context,
                                                 tls_hostname=host if tls else None)
        except TimeoutError:
            raise UpstreamTimeout(f"connecting to the gateway took more than {timeout_s:g}s") from None
        except (OSError, ssl.SSLError) as exc:
            raise UpstreamUnreachable(f"the model gateway is unreachable ({exc.__class__.__name__})") from None
        raw = stream.extra(SocketAttribute.raw_socket, None)
        if raw is not None and raw.family in (socket.AF_INET, socket.AF_INET6):
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # SSE frames are small writes
        return stream

    return connect


@dataclass
class _Connection:
    stream: ByteStream
    parser: Parser = field(default_factory=lambda: Parser(request=False))
    idle_since: float = field(default_factory=time.monotonic)
    keep_alive: bool = True
    raw: socket.socket | None = field(init=False)  # looked up once: anyio's typed attributes cost per call

    def __post_init__(self) -> None:
        self.raw = self.stream.extra(SocketAttribute.raw_socket, None)

    def looks_closed(self) -> bool:
        """An idle keep-alive connection that is readable has been closed by the server."""
        if self.raw is None:
            return False
        try:
            readable, _, _ = select.select([self.raw], [], [], 0)
        except (OSError, ValueError):
            return True
        return bool(readable)

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ssl.SSLError):
                pass


class UpstreamResponse:
    """Status, raw headers, and the body as it arrives. Close it (``aclose``) in every case:
    a response read to its end returns its connection to the pool, any other is closed."""

    def __init__(self, upstream: Upstream, conn: _Connection, head: Head) -> None:
        self._upstream, self._conn = upstream, conn
        self.status: int = head.status
        self.reason: bytes = head.reason
        self.headers: list[tuple[bytes, bytes]] = head.headers
        conn.keep_alive = head.keep_alive
        self._done = False
        self._closed = False

    def header(self, name: bytes) -> str | None:
        for k, v in self.headers:
            if k == name:
                return v.decode("latin-1")
        return None

    async def next_chunk(self) -> bytes | None:
        """The next body bytes (de-chunked, never decoded) as a read brings them; None at the
        end. Raises UpstreamTimeout after ``read_s`` of silence, UpstreamBrokeOff if it breaks."""
        while (chunk := self.ready_chunk()) is NEED_DATA:
            self._conn.parser.feed(await self._receive())
        return chunk  # type: ignore[return-value]

    def ready_chunk(self) -> bytes | None | object:
        """What the reads so far already brought, without reading: the next body bytes, None at
        the end, or ``NEED_DATA`` when only another read can tell. The proxy uses it to write
        what has arrived in one write and never to wait for more."""
        try:
            event = self._conn.parser.next_event()
        except ProtocolError as exc:
            raise UpstreamBrokeOff(f"the gateway's answer broke off: {exc}") from None
        if event is NEED_DATA or isinstance(event, bytes):
            return event
        if event is END:
            self._done = True
            return None
        raise UpstreamBrokeOff("the gateway closed the connection mid-answer")

    async def _receive(self) -> bytes:
        read_s = self._upstream.timeouts.read_s
        try:
            with anyio.fail_after(read_s):
                return await self._conn.stream.receive(RECEIVE_SIZE)
        except TimeoutError:
            raise UpstreamTimeout(f"the gateway sent nothing for {read_s:g}s") from None
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError, ssl.SSLError):
            return b""  # the parser tells a clean end from a cut one

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._upstream._release(self._conn, reusable=self._done)


class Upstream:
    """``async with Upstream(url) as up: resp = await up.send(method, target, headers, body)``."""

    def __init__(self, base_url: str, *, timeouts: Timeouts | None = None, connector: Connector | None = None,
                 tls_context: ssl.SSLContext | None = None, max_idle: int = 64) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"upstream_url: {base_url!r} is not an http(s) URL")
        self.timeouts = timeouts or Timeouts()
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        self.host_header = parts.netloc.rsplit("@", 1)[-1].encode("idna")
        self.base_path = parts.path.rstrip("/")
        self._connect = connector or tcp_connector(parts.hostname, port, tls=tls, timeout_s=self.timeouts.connect_s,
                                                   tls_context=tls_context)
        self._idle: list[_Connection] = []
        self._max_idle = max_idle

    async def __aenter__(self) -> Upstream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()

    def _take_idle(self) -> tuple[_Connection | None, list[_Connection]]:
        """A pooled connection fit for reuse, and the stale ones found on the way."""
        now, stale = time.monotonic(), []
        while self._idle:
            conn = self._idle.pop()
            if now - conn.idle_since < self.timeouts.keepalive_s and not conn.looks_closed():
                return conn, stale
            stale.append(conn)
        return None, stale

    async def send(self, method: str, target: str, headers: list[tuple[str, str]], body: bytes) -> UpstreamResponse:
        """Send one request (``target`` is appended to the base URL's path); the response head
        is back when this returns. A reused connection that turns out closed before any byte of
        an answer is retried once on a new one (the gateway cannot have seen the request)."""
        request = request_bytes(method, (self.base_path + target).encode("ascii"),
                                [(b"host", self.host_header),
                                 *((n.encode("latin-1"), v.encode("latin-1")) for n, v in headers)], body)
        for attempt in (0, 1):
            conn, stale = self._take_idle() if attempt == 0 else (None, [])
            for old in stale:
                await old.close()
            reused = conn is not None
            if conn is None:
                conn = _Connection(await self._connect())
            try:
                return await self._exchange(conn, request, head_only=method == "HEAD")
            except _StaleConnection:
                await conn.close()
                if not reused or attempt:
                    raise UpstreamBrokeOff("the gateway closed the connection before answering") from None
            except BaseException:
                await conn.close()
                raise
        raise AssertionError("unreachable")

    async def _exchange(self, conn: _Connection, request: bytes, *, head_only: bool) -> UpstreamResponse:
        conn.parser.end_at_head = head_only
        try:
            with anyio.fail_after(self.timeouts.write_s):
                await conn.stream.send(request)  # the whole request in one write
        except TimeoutError:
            raise UpstreamTimeout(f"the gateway took no request bytes for {self.timeouts.write_s:g}s") from None
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError, ssl.SSLError):
            raise _StaleConnection from None
        got_bytes = False
        with anyio.move_on_after(self.timeouts.read_s) as scope:
            while True:
                try:
                    event = conn.parser.next_event()
                except ProtocolError as exc:
                    raise UpstreamBrokeOff(f"the gateway's answer is not HTTP: {exc}") from None
                if event is NEED_DATA:
                    try:
                        chunk = await conn.stream.receive(RECEIVE_SIZE)
                    except (anyio.EndOfStream, anyio.BrokenResourceError, OSError, ssl.SSLError):
                        chunk = b""
                    if not chunk and not got_bytes:
                        raise _StaleConnection
                    got_bytes = True
                    conn.parser.feed(chunk)
                elif isinstance(event, Head) and event.status >= 200:
                    return UpstreamResponse(self, conn, event)
                elif isinstance(event, Head) or event is END:
                    continue  # 100 Continue and friends (and their empty end): the real answer follows
                else:
                    raise UpstreamBrokeOff("the gateway closed the connection before answering")
        assert scope.cancelled_caught
        raise UpstreamTimeout(f"the gateway did not answer within {self.timeouts.read_s:g}s")

    async def _release(self, conn: _Connection, *, reusable: bool) -> None:
        if reusable and conn.keep_alive and len(self._idle) < self._max_idle:
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            await conn.close()


class _StaleConnection(Exception):
    pass
