"""One request from a sandbox: allow-list, key swap, forward, stream back, record.

Upstream statuses, headers and bodies reach the sandbox unchanged (the CLIs' own retry logic
must see the real 429/5xx/400), with three exceptions that exist for the key's sake:
credential headers never go up, the real key is redacted wherever an upstream would echo it
(headers, error bodies), and ``accept-encoding`` is ``identity`` upstream so the proxy can
read what it audits. Answers are written to the sandbox chunk by chunk as they arrive: no
buffering of SSE. A request body is read whole first (bounded by ``max_body_bytes``, each
read under the body timeout): the audit needs all of it, and a body that turns out too large
or stalls is answered 413/408 without ever reaching the gateway half-sent.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import anyio
import structlog

from .audit import RequestAudit, audit_request, reply_fields
from .audit_memo import AuditMemo
from .framing import NEED_DATA, FramingError, Head
from .http1 import BodyTimeout, BodyTooLarge, ClientConnection, ClientGone, MalformedBody
from .keys import KeySource, KeyUnavailable, is_credential_header, key_headers
from .metrics import ProxyMetrics
from .records import WireRecord, WireSink
from .reply import ReplyReader
from .routes import Route, match, parse_target
from .upstream import Upstream, UpstreamBrokeOff, UpstreamError, UpstreamResponse, UpstreamTimeout

log = structlog.get_logger("proxy")

TurnLookup = Callable[[str, str], "str | None"]  # (chat_key, member_key) -> running job id
# Test seam only (route name, body) -> body: stands in for a CLI that sent a changed history.
# The daemon's configuration has no way to set it (runner.turn.TestHooks).
Rewrite = Callable[[str, bytes], bytes]

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
                        "upgrade", "proxy-authenticate"})
_NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect", "accept-encoding"}
REQUEST_ID_HEADERS = (b"request-id", b"x-request-id", b"anthropic-request-id", b"openai-request-id",
                      b"x-amzn-requestid")
MAX_ERROR_BODY = 4 << 20  # error answers are buffered (to redact the key) up to this size
INLINE_AUDIT_BYTES = 32 * 1024


@dataclass
class ProxyContext:
    """What every exchange of one proxy host shares."""

    upstream: Upstream
    keys: KeySource
    metrics: ProxyMetrics
    sink: WireSink | None = None
    turn_of: TurnLookup | None = None
    capture: bool = False
    rewrite: Rewrite | None = None
    audit_memo: AuditMemo | None = None
    _seq: int = 0

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq


@dataclass
class Draft:
    """The record under construction (fields filled as the exchange goes)."""

    seq: int
    chat_key: str
    member_key: str | None
    method: str
    path: str
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    t0: float = field(default_factory=time.perf_counter)
    route: Route | None = None
    job_id: str | None = None
    status: int = 0
    upstream_request_id: str | None = None
    bytes_in: int = 0
    bytes_out: int = 0
    error: str | None = None
    audit: RequestAudit | None = None
    reply: ReplyReader | None = None


def _connection_tokens(headers: list[tuple[bytes, bytes]]) -> set[str]:
    tokens: set[str] = set()
    for name, value in headers:
        if name.lower() == b"connection":
            tokens |= {t.strip().lower() for t in value.decode("latin-1").split(",") if t.strip()}
    return tokens


def upstream_headers(headers: list[tuple[bytes, bytes]], route: Route, key: str) -> list[tuple[str, str]]:
    """The sandbox's headers minus hop-by-hop and credentials, plus the real key."""
    named = _connection_tokens(headers)
    used_x_api_key = False
    out: list[tuple[str, str]] = []
    for raw_name, raw_value in headers:
        name = raw_name.decode("latin-1").lower()
        if name == "x-api-key":
            used_x_api_key = True
        if name in _NOT_FORWARDED or name in named or is_credential_header(name):
            continue
        out.append((name, raw_value.decode("latin-1")))
    for name, value in headers:
        if name.lower() == b"content-length":
            out.append(("content-length", value.decode("latin-1")))
            break
    family = route.family or ("anthropic" if used_x_api_key else "openai")
    out += list(key_headers(family, key).items())
    out.append(("accept-encoding", "identity"))
    return out


def _redact(data: bytes, key: str) -> bytes:
    return data.replace(key.encode(), b"[redacted]") if key and key.encode() in data else data


def response_headers(headers: list[tuple[bytes, bytes]], key: str, *,
                     body_length: int | None = None) -> list[tuple[bytes, bytes]]:
    """The upstream's headers minus hop-by-hop (the sandbox's copy is framed anew), key redacted."""
    named = _connection_tokens(headers)
    out = []
    for raw_name, raw_value in headers:
        name = raw_name.lower()
        text = name.decode("latin-1")
        if text in HOP_BY_HOP or text in named or (body_length is not None and text == "content-length"):
            continue
        out.append((name, _redact(raw_value, key)))
    if body_length is not None:
        out.append((b"content-length", str(body_length).encode()))
    return out


class Exchange:
    def __init__(self, ctx: ProxyContext, conn: ClientConnection, chat_key: str, user_id: str) -> None:
        self.ctx, self.conn, self.chat_key, self.user_id = ctx, conn, chat_key, user_id

    async def run(self, req: Head) -> tuple[bool, WireRecord]:
        """Answer ``req``; returns (keep the connection, the record)."""
        target = parse_target(req.target.decode("ascii", "replace"))
        d = Draft(self.ctx.next_seq(), self.chat_key, target.member_key, req.method.decode("ascii", "replace"),
                  target.path)
        keep = False
        try:
            keep = await self._run(req, target.query, d)
        except ClientGone as exc:
            d.error = d.error or f"client_gone: {exc}"
            d.status = d.status or 499
        return keep, self._record(d)

    async def _deny(self, d: Draft, reason: str, message: str) -> bool:
        self.ctx.metrics.denied.labels(reason=reason).inc()
        d.status, d.error = 403, reason
        d.bytes_out = await self.conn.answer(403, "forbidden", message, close=True)
        return False

    async def _reject(self, d: Draft, status: int, reason: str, message: str) -> bool:
        self.ctx.metrics.rejected.labels(reason=reason).inc()
        d.status, d.error = status, reason
        if not self.conn.response_started:
            d.bytes_out = await self.conn.answer(status, reason, message, close=True)
        return False

    async def _run(self, req: Head, query: str, d: Draft) -> bool:
        if d.member_key is None:
            return await self._deny(d, "no_member", "requests must use the member base URL (/m/<member>/…)")
        if self.ctx.turn_of is not None:  # looked up first: a denied request still names its turn
            try:
                d.job_id = self.ctx.turn_of(self.chat_key, d.member_key)
            except Exception:
                log.exception("proxy.turn_lookup_failed", chat_key=self.chat_key, member_key=d.member_key)
        route = match(d.method, d.path)
        if route is None:
            return await self._deny(d, "not_a_model_route", f"{d.method} {d.path} is not a model route")
        d.route = route
        length = req.header(b"content-length")
        if length is not None and int(length) > self.conn.limits.max_body_bytes:
            return await self._reject(d, 413, "body_too_large",
                                      f"request body larger than {self.conn.limits.max_body_bytes} bytes")
        try:
            key = await self.ctx.keys.key_for(self.user_id)
        except KeyUnavailable as exc:
            return await self._reject(d, 503, "gateway_key_unavailable", str(exc))
        return await self._forward(req, query, route, key, d)

    async def _forward(self, req: Head, query: str, route: Route, key: str, d: Draft) -> bool:
        await self.conn.continue_100()
        body = bytearray()
        try:
            async for chunk in self.conn.body():
                body += chunk
        except BodyTooLarge as exc:
            return await self._reject(d, 413, "body_too_large", str(exc))
        except BodyTimeout as exc:
            return await self._reject(d, 408, "body_timeout", str(exc))
        except MalformedBody as exc:
            return await self._reject(d, 400, "bad_request", str(exc))
        raw = bytes(body)
        if self.ctx.rewrite is not None:
            raw = self.ctx.rewrite(route.name, raw)
        d.bytes_in = len(raw)
        headers = upstream_headers(req.headers, route, key)
        if self.ctx.rewrite is not None:
            headers = [(n, v) for n, v in headers if n != "content-length"]
        if raw and not any(name == "content-length" for name, _ in headers):
            headers.append(("content-length", str(len(raw))))  # a chunked body goes up with its length
        target = route.path + (f"?{query}" if query else "")
        gone: ClientGone | None = None
        keep = False
        try:
            resp = await self.ctx.upstream.send(d.method, target, headers, raw)
        except UpstreamError as exc:
            status = 504 if isinstance(exc, UpstreamTimeout) else 502
            keep = await self._reject(d, status, exc.reason, str(exc))
        else:
            try:
                keep = await self._respond(resp, route, key, d)
            except ClientGone as exc:
                gone = exc
            finally:
                with anyio.CancelScope(shield=True):
                    await resp.aclose()  # mid-stream this closes the upstream connection: the request is cancelled
        # audited once the sandbox has its answer: off the answer's path, no GIL contention while it streams
        with anyio.CancelScope(shield=True):
            await self._audit(d, raw, req_header(req, b"content-encoding"), route)
        if gone is not None:
            raise gone
        return keep

    async def _audit(self, d: Draft, raw: bytes, encoding: str | None, route: Route) -> None:
        member = (d.chat_key, d.member_key) if d.member_key is not None else None

        def audit() -> RequestAudit:
            return audit_request(raw, encoding, route, capture=self.ctx.capture, memo=self.ctx.audit_memo,
                                 member=member)

        # a long conversation is parsed in a worker thread; a short one costs less than the hop
        d.audit = await anyio.to_thread.run_sync(audit) if len(raw) > INLINE_AUDIT_BYTES else audit()
        self.ctx.metrics.audited(d.audit.walked, d.audit.remembered)

    async def _respond(self, resp: UpstreamResponse, route: Route, key: str, d: Draft) -> bool:
        d.status = resp.status
        d.upstream_request_id = next((v for h in REQUEST_ID_HEADERS if (v := resp.header(h)) is not None), None)
        content_type = resp.header(b"content-type") or ""
        if resp.status >= 400 and "text/event-stream" not in content_type:
            return await self._respond_buffered(resp, key, d)
        d.reply = ReplyReader(route.api, content_type) if resp.status < 300 else None
        # the head is held, not written: it goes out with the body bytes that came in the same
        # read, and nothing held ever waits for a read (flush first)
        self.conn.hold_head(resp.status, response_headers(resp.headers, key), resp.reason)
        gone = False
        with anyio.CancelScope() as scope:
            def closed() -> None:
                nonlocal gone
                gone = True
                scope.cancel()

            with self.conn.watch_close(closed):
                try:
                    while True:
                        if (chunk := resp.ready_chunk()) is NEED_DATA:
                            await self.conn.flush()
                            chunk = await resp.next_chunk()
                        if chunk is None:
                            break
                        if d.reply is not None:
                            d.reply.feed(chunk)
                        if chunk:
                            self.conn.hold_data(chunk)
                        d.bytes_out += len(chunk)
                    self.conn.hold_end()
                    await self.conn.flush()
                except (UpstreamError, FramingError) as exc:
                    # the upstream broke off mid-body: end the sandbox's stream the same way, after
                    # the bytes that did arrive
                    with contextlib.suppress(ClientGone):
                        await self.conn.flush()
                    self.ctx.metrics.rejected.labels(reason="upstream_broke_off").inc()
                    d.error, d.reply = f"upstream_broke_off: {exc.__class__.__name__}", None
                    return False
        if gone:
            raise ClientGone("closed the connection while the answer streamed")
        return self.conn.reusable()

    async def _respond_buffered(self, resp: UpstreamResponse, key: str, d: Draft) -> bool:
        data = bytearray()
        try:
            while (chunk := await resp.next_chunk()) is not None:
                data += chunk
                if len(data) > MAX_ERROR_BODY:
                    raise UpstreamBrokeOff(f"error body larger than {MAX_ERROR_BODY} bytes")
        except UpstreamError as exc:
            self.ctx.metrics.rejected.labels(reason="upstream_broke_off").inc()
            d.error = f"upstream_broke_off: {exc.__class__.__name__}"
            return False
        body = _redact(bytes(data), key)
        await self.conn.respond(resp.status, response_headers(resp.headers, key, body_length=len(body)), body,
                                resp.reason)
        d.bytes_out = len(body)
        return self.conn.reusable()

    # ---------------------------------------------------------------- record

    def _record(self, d: Draft) -> WireRecord:
        route = d.route
        audit = d.audit
        kind = audit.kind if audit is not None else (route.kind if route and route.kind else "other")
        reply, reply_capture = reply_fields(d.reply.result() if d.reply is not None else None, capture=self.ctx.capture)
        rec = WireRecord(
            seq=d.seq, chat_key=d.chat_key, member_key=d.member_key, job_id=d.job_id, started_at=d.started_at,
            duration_ms=round((time.perf_counter() - d.t0) * 1000, 3), method=d.method, path=d.path,
            route=route.name if route else None, api=route.api if route else None,
            kind=kind, side=kind != "conversation", status=d.status or 499,
            upstream_request_id=d.upstream_request_id, bytes_in=d.bytes_in, bytes_out=d.bytes_out, error=d.error,
            digest=audit.digest if audit else None, digest_error=audit.digest_error if audit else None,
            reply=reply if kind == "conversation" else None, capture=audit.capture if audit else None,
            reply_capture=reply_capture if kind == "conversation" else None)
        m = self.ctx.metrics
        m.requests.labels(route=rec.route or "denied", status=str(rec.status)).inc()
        m.bytes.labels(direction="in").inc(rec.bytes_in)
        m.bytes.labels(direction="out").inc(rec.bytes_out)
        return rec


def req_header(req: Head, name: bytes) -> str | None:
    value = req.header(name)
    return value.decode("latin-1") if value is not None else None
