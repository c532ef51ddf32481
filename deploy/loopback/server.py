"""The loopback model gateway: one threaded stdlib HTTP server on 127.0.0.1.

Why stdlib ``ThreadingHTTPServer``: a test can start it in-process from sync or async code
without an event loop, every request gets its own thread (OpenCode sends its title request
concurrently with the conversation request; a stalled stream blocks nobody), and the
per-request overhead stays close to a bare echo server (see ``tests/bench/bench_fixture.py``).
Responses use HTTP/1.1 chunked transfer so the Node/Bun/Rust clients can keep connections alive.

Routes: ``POST /v1/messages`` (any query, e.g. ``?beta=true``), ``POST /v1/responses``,
``POST /v1/chat/completions`` (the ``/v1`` prefix is optional), ``HEAD`` on any path (200),
and the control API under ``/_fixture/`` (never recorded).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import secrets
import socket
import threading
import time
import zlib
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import structlog
from pydantic import TypeAdapter, ValidationError

from .audit import classify
from .behaviour import Behaviour, Plan, error_body
from .models import Kind, RecordedRequest, Rule, Script
from .recorder import Recorder, credential_fingerprints, safe_headers
from .sse import FRAMES, JSON_BODIES

log = structlog.get_logger("loopback")

_RULES = TypeAdapter(list[Rule])
_REQUIRED = {"anthropic": "messages", "responses": "input", "chat": "messages"}


def api_for_path(path: str) -> str:
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/messages"):
        return "anthropic"
    return "other"


class Malformed(Exception):
    pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    behaviour: Behaviour
    recorder: Recorder
    stopping: threading.Event
    control_token: str
    releases: threading.Condition  # notified by LoopbackFixture.release_stalls
    release_count: int = 0
    holding: int = 0  # stalls in progress (a test waits for its stall to begin before releasing it)

    def hold(self, seconds: float) -> None:
        """A stall: until ``seconds`` pass, the fixture closes, or a test releases its stalls."""
        with self.releases:
            seen = self.release_count
            self.holding += 1
            self.releases.notify_all()
            try:
                self.releases.wait_for(lambda: self.stopping.is_set() or self.release_count != seen,
                                       timeout=seconds)
            finally:
                self.holding -= 1


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def setup(self) -> None:
        super().setup()
        # Every SSE frame is its own small write: without TCP_NODELAY, Nagle plus the peer's
        # delayed ACK add ~40 ms to each request (measured with tests/bench/bench_fixture.py).
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # structlog covers it

    # ---------------------------------------------------------------- plumbing

    def _read_body(self) -> bytes:
        if "chunked" in (self.headers.get("transfer-encoding") or "").lower():
            data = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    break
                data += self.rfile.read(size)
                self.rfile.readline()
            raw = bytes(data)
        else:
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
        encoding = (self.headers.get("content-encoding") or "").lower()
        if encoding in ("gzip", "deflate") and raw:
            raw = zlib.decompress(raw, 47)  # 47: auto-detect gzip or zlib header
        return raw

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status, "Overloaded" if status == 529 else None)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))

    # ---------------------------------------------------------------- verbs

    def do_HEAD(self) -> None:
        parts = urlsplit(self.path)
        rec = self._new_record("HEAD", parts.path, parts.query, "head", "probe", None, None)
        rec.status = 200
        self.send_response(200)
        self.send_header("content-length", "0")
        self.end_headers()
        self.server.recorder.finish(rec)

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def do_PUT(self) -> None:
        self._dispatch("PUT")

    def do_DELETE(self) -> None:
        self._dispatch("DELETE")

    def do_PATCH(self) -> None:
        self._dispatch("PATCH")

    # ---------------------------------------------------------------- dispatch

    def _new_record(self, method: str, path: str, query: str, api: str, kind: Kind, body: Any,
                    raw: str | None) -> RecordedRequest:
        rec = RecordedRequest(seq=self.server.recorder.next_seq(), time=time.time(), method=method, path=path,
                              query=query, api=api, kind=kind, headers=safe_headers(self.headers.items()),
                              credentials=credential_fingerprints(self.headers.items()),
                              body=body, raw=raw)  # type: ignore[arg-type]
        self.server.recorder.add(rec)
        return rec

    def _dispatch(self, method: str) -> None:
        parts = urlsplit(self.path)
        try:
            raw = self._read_body()
        except (ValueError, zlib.error) as exc:
            raw, read_error = b"", f"unreadable body: {exc}"
        else:
            read_error = None
        if parts.path.startswith("/_fixture/"):
            self._control(method, parts.path, parts.query, raw)
            return
        api = api_for_path(parts.path)
        text = raw.decode("utf-8", errors="replace")
        body: Any = None
        try:
            if read_error:
                raise Malformed(read_error)
            if api == "other":
                raise Malformed(f"no such route: {method} {parts.path}")
            if method != "POST":
                raise Malformed(f"method {method} is not allowed on {parts.path}; use POST")
            try:
                body = json.loads(raw)
            except ValueError as exc:
                raise Malformed(f"request body is not valid JSON: {exc}") from None
            if not isinstance(body, dict):
                raise Malformed("request body must be a JSON object")
            field = _REQUIRED[api]
            value = body.get(field)
            if not (isinstance(value, list) or (api == "responses" and isinstance(value, str))):
                raise Malformed(f"{field}: field required (a list)")
        except Malformed as exc:
            status = 404 if api == "other" else 400
            rec = self._new_record(method, parts.path, parts.query, api, "other",
                                   body, None if isinstance(body, dict) else text)
            rec.status, rec.error, rec.action = status, str(exc), "error"
            code = "not_found" if status == 404 else "invalid_request"
            self._send_json(status, error_body("openai" if api == "other" else api, status, str(exc), code=code))
            self.server.recorder.finish(rec)
            log.debug("loopback.malformed", seq=rec.seq, path=parts.path, error=str(exc))
            return
        kind = classify(body, api, method)
        rec = self._new_record(method, parts.path, parts.query, api, kind, body, None)
        plan = self.server.behaviour.decide(body, api, kind, rec.seq)
        rec.status, rec.rule, rec.action = plan.status, plan.rule, plan.action
        rec.reply_text, rec.tool_call = plan.reply_text, plan.tool_call
        log.debug("loopback.request", seq=rec.seq, api=api, kind=kind, status=plan.status, rule=plan.rule,
                 action=plan.action)
        try:
            self._respond(api, body, rec.seq, plan)
        except (BrokenPipeError, ConnectionResetError, TimeoutError) as exc:
            rec.error = f"client went away: {exc.__class__.__name__}"
            self.close_connection = True
        finally:
            self.server.recorder.finish(rec)

    def _respond(self, api: str, body: dict[str, Any], seq: int, plan: Plan) -> None:
        rid = f"req_fx{seq:06d}"
        id_header = {"request-id": rid} if api == "anthropic" else {"x-request-id": rid}
        if plan.status != 200:
            self._send_json(plan.status, plan.error_body, {**id_header, **plan.headers})
            return
        model = str(body.get("model") or "fixture-model")
        if body.get("stream") is not True:
            self._send_json(200, JSON_BODIES[api](plan.items, model, seq), id_header)
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream; charset=utf-8")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        for k, v in id_header.items():
            self.send_header(k, v)
        self.end_headers()
        deltas = 0
        for i, (frame, is_delta) in enumerate(FRAMES[api](plan.items, model, seq)):
            if plan.cut_after is not None and is_delta and deltas >= plan.cut_after:
                self._end_cut(plan.abort)
                return
            self._chunk(frame)
            deltas += is_delta
            if i == 0 and plan.stall:
                self.server.hold(plan.stall)
        if plan.cut_after is not None:  # fewer deltas than the cut point: still drop the final events
            self._end_cut(plan.abort)
            return
        self.wfile.write(b"0\r\n\r\n")

    def _end_cut(self, abort: bool) -> None:
        if abort:
            # no terminating chunk: the client sees the body end mid-transfer
            self.close_connection = True
            try:
                self.connection.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        else:
            self.wfile.write(b"0\r\n\r\n")

    # ---------------------------------------------------------------- control API

    def _control(self, method: str, path: str, query: str, raw: bytes) -> None:
        server, route = self.server, path[len("/_fixture"):]
        if route != "/health" and not _token_ok(self.headers.get("authorization", ""), server.control_token):
            # SPEC 9.3: reading every tenant's requests or scripting replies needs the fixture's own token
            self._send_json(401, {"error": {"message": "the fixture's control routes need its control token"}})
            return
        try:
            if method == "GET" and route == "/requests":
                q = parse_qs(query)
                since = int(q.get("since", ["0"])[0])
                records = [r for r in server.recorder.all() if r.seq > since
                           and ("kind" not in q or r.kind in q["kind"]) and ("api" not in q or r.api in q["api"])]
                self._send_json(200, {"requests": [r.model_dump(mode="json") for r in records]})
            elif method == "GET" and route == "/rules":
                self._send_json(200, {"rules": [r.model_dump(mode="json") for r in server.behaviour.rules()]})
            elif method == "POST" and route == "/rules":
                payload = json.loads(raw or b"[]")
                replace = isinstance(payload, dict) and bool(payload.get("replace"))
                if isinstance(payload, dict) and "rules" in payload:
                    rules = Script.model_validate({"rules": payload["rules"]}).rules
                elif isinstance(payload, dict):
                    rules = [Rule.model_validate(payload)]
                else:
                    rules = _RULES.validate_python(payload)
                if replace:
                    server.behaviour.clear()
                server.behaviour.add(rules)
                self._send_json(200, {"rules": [r.id for r in rules]})
            elif method == "POST" and route == "/reset":
                payload = json.loads(raw) if raw.strip() else {}
                if payload.get("requests", True):
                    server.recorder.clear()
                if payload.get("rules", True):
                    server.behaviour.clear()
                self._send_json(200, {"ok": True})
            elif method == "GET" and route == "/health":
                self._send_json(200, {"ok": True})
            else:
                self._send_json(404, {"error": {"message": f"no control route {method} {path}"}})
        except (ValueError, ValidationError, AttributeError) as exc:
            self._send_json(422, {"error": {"message": str(exc)}})


def _token_ok(header: str, token: str) -> bool:
    scheme, _, presented = header.partition(" ")
    expected = hashlib.sha256(token.encode()).digest()
    return hmac.compare_digest(hashlib.sha256(presented.strip().encode()).digest(), expected) and \
        scheme.lower() == "bearer"


def _check_loopback(host: str) -> None:
    if host == "localhost":
        return
    if not ipaddress.ip_address(host).is_loopback:
        raise ValueError(f"the loopback fixture only listens on loopback addresses, not {host!r}")


class LoopbackFixture:
    """An in-process fixture serving in a background thread.

    ``with LoopbackFixture.start(port=0) as fx: ... fx.base_url`` (also ``async with``).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, record_path: str | None = None,
                 rules: list[Rule] | None = None, control_token: str | None = None) -> None:
        _check_loopback(host)
        # The control routes (/_fixture/*) always need this token; in-process users read
        # ``fx.recorder`` and ``fx.behaviour`` directly, other processes get it from the starter.
        self.control_token = control_token or secrets.token_hex(24)
        self.behaviour = Behaviour(rules)
        self.recorder = Recorder(record_path)
        self._server = _Server((host, port), _Handler)
        self._server.behaviour, self._server.recorder = self.behaviour, self.recorder
        self._server.control_token = self.control_token
        self._server.stopping = threading.Event()
        self._server.releases = threading.Condition()
        self._thread: threading.Thread | None = None
        self.host, self.port = host, self._server.server_address[1]

    @classmethod
    def start(cls, host: str = "127.0.0.1", port: int = 0, *, record_path: str | None = None,
              rules: list[Rule] | None = None, script: Script | str | None = None,
              control_token: str | None = None) -> LoopbackFixture:
        """Create and start a fixture. ``script``: a Script or the path of a JSON script file."""
        if isinstance(script, str):
            with open(script, encoding="utf-8") as f:
                script = Script.model_validate_json(f.read())
        fx = cls(host, port, record_path=record_path, rules=(rules or []) + (script.rules if script else []),
                 control_token=control_token)
        fx._thread = threading.Thread(target=fx._server.serve_forever, kwargs={"poll_interval": 0.05},
                                      name=f"loopback-{fx.port}", daemon=True)
        fx._thread.start()
        log.debug("loopback.started", url=fx.base_url)
        return fx

    # ---- addresses
    @property
    def base_url(self) -> str:
        """Root URL: Claude's ANTHROPIC_BASE_URL, pi's anthropic baseUrl."""
        return f"http://{self.host}:{self.port}"

    @property
    def openai_base_url(self) -> str:
        """``base_url + "/v1"``: Codex ``base_url``, pi/OpenCode/Kilo OpenAI ``baseURL``."""
        return f"{self.base_url}/v1"

    # ---- script
    def add_rule(self, rule: Rule) -> Rule:
        self.behaviour.add([rule])
        return rule

    def add_rules(self, *rules: Rule) -> list[Rule]:
        self.behaviour.add(list(rules))
        return list(rules)

    def set_rules(self, rules: list[Rule]) -> None:
        self.behaviour.clear()
        self.behaviour.add(rules)

    def rules(self) -> list[Rule]:
        return self.behaviour.rules()

    # ---- records
    def requests(self, *, api: str | None = None, kind: str | None = None, since: int = 0) -> list[RecordedRequest]:
        return [r for r in self.recorder.all()
                if r.seq > since and (api is None or r.api == api) and (kind is None or r.kind == kind)]

    def conversation_requests(self, api: str | None = None) -> list[RecordedRequest]:
        return self.requests(api=api, kind="conversation")

    def last(self, kind: str | None = "conversation", api: str | None = None) -> RecordedRequest | None:
        found = self.requests(api=api, kind=kind)
        return found[-1] if found else None

    def wait_for(self, predicate: Callable[[list[RecordedRequest]], bool], timeout: float = 10.0) -> list[RecordedRequest]:
        """Poll the records until ``predicate(records)`` holds; TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            records = self.recorder.all()
            if predicate(records):
                return records
            if time.monotonic() > deadline:
                raise TimeoutError(f"fixture condition not met within {timeout}s ({len(records)} requests)")
            time.sleep(0.02)

    def reset(self, *, requests: bool = True, rules: bool = True) -> None:
        if requests:
            self.recorder.clear()
        if rules:
            self.behaviour.clear()

    def wait_stalled(self, n: int = 1, timeout: float = 30.0) -> None:
        """Block until ``n`` stalls are in progress (their first event sent, the rest held)."""
        with self._server.releases:
            if not self._server.releases.wait_for(lambda: self._server.holding >= n, timeout=timeout):
                raise TimeoutError(f"{self._server.holding} stall(s) in progress after {timeout}s, expected {n}")

    def release_stalls(self) -> None:
        """End every stall in progress now (a test holds a turn until it has seen what it needs)."""
        with self._server.releases:
            self._server.release_count += 1
            self._server.releases.notify_all()

    # ---- lifecycle
    def close(self) -> None:
        self._server.stopping.set()  # wakes stalled streams
        with self._server.releases:
            self._server.releases.notify_all()
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout=5)
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> LoopbackFixture:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> LoopbackFixture:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
