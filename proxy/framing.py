"""HTTP/1.1 framing for both sides of the proxy: llhttp (httptools, in C) parses, this module
queues what it found as events, and writes heads and bodies by hand.

Why not h11 (it was the proxy's parser on both sides until issue 12's benchmark): h11 is a
pure-Python state machine, a few hundred calls per request and per SSE chunk; with httptools
the parse is one C call per read. What h11 gave and the proxy relies on is kept here:

* events in order — a :class:`Head`, body bytes as they arrive, :data:`END` — and
  :data:`NEED_DATA` when only another read can tell; :data:`CLOSED` for a clean end between
  messages; malformed input raises :class:`ProtocolError` with the status to answer (400, or
  431 for a head over its bound), only after the events before it were taken;
* header names lower-case, values without surrounding whitespace;
* the keep-alive decision (HTTP/1.0 without keep-alive, ``connection: close``) and an answer's
  framing from its headers: its own ``content-length``, else chunked for an HTTP/1.1 peer,
  else until close; no body for HEAD, 1xx, 204 and 304.

A response to HEAD carries no body whatever its ``content-length`` says, and llhttp cannot be
told so through httptools: the client side ends such a response at its head and does not
reuse the connection (``Parser.end_at_head``).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from http import HTTPStatus
from typing import Final

import httptools


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return self.name


NEED_DATA: Final = _Marker("NEED_DATA")  # only another read can tell what comes next
END: Final = _Marker("END")  # the message's body is complete
CLOSED: Final = _Marker("CLOSED")  # the peer closed cleanly between messages


class ProtocolError(Exception):
    """The peer's bytes are not HTTP/1.1 we accept; ``status`` is what to answer (as a server)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(slots=True)
class Head:
    """A request or response head (``method``/``target`` for requests, ``status``/``reason``
    for responses)."""

    headers: list[tuple[bytes, bytes]]
    method: bytes = b""
    target: bytes = b""
    status: int = 0
    reason: bytes = b""
    http_version: str = "1.1"
    keep_alive: bool = True

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None


Event = Head | bytes | _Marker


class Parser:
    """One connection's incoming side. ``feed`` bytes (``b""`` is the end of the stream),
    then take events with ``next_event`` until :data:`NEED_DATA`."""

    def __init__(self, *, request: bool, max_head_bytes: int = 256 * 1024) -> None:
        self._request = request
        self._llhttp = httptools.HttpRequestParser(self) if request else httptools.HttpResponseParser(self)
        self._max_head = max_head_bytes
        self._events: deque[Event] = deque()
        self._error: ProtocolError | None = None
        self._eof = False
        self._in_message = False  # a message has begun and not completed
        self._in_head = False  # its head is not complete yet
        self._head_bytes = 0
        self._url = b""
        self._reason = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._close_delimited = False  # a response body that ends when the connection does
        self._ended_at_head = False
        self.end_at_head = False  # set by a client that sent HEAD: the next response has no body

    # llhttp callbacks -----------------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._in_message = self._in_head = True
        self._url, self._reason, self._headers = b"", b"", []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_status(self, reason: bytes) -> None:
        self._reason += reason

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value.strip()))

    def on_headers_complete(self) -> None:
        p = self._llhttp
        self._in_head, self._head_bytes = False, 0
        head = Head(self._headers, http_version=p.get_http_version(), keep_alive=p.should_keep_alive())
        if self._request:
            head.method, head.target = p.get_method(), self._url
        else:
            head.status, head.reason = p.get_status_code(), self._reason
            self._close_delimited = (head.status >= 200 and head.status not in (204, 304)
                                     and head.header(b"content-length") is None
                                     and b"chunked" not in (head.header(b"transfer-encoding") or b"").lower())
            if self.end_at_head and head.status >= 200:
                self._ended_at_head = True
                head.keep_alive = False
        self._events.append(head)
        if self._ended_at_head:
            self._events.append(END)
            raise _StopParsing  # nothing after it is this response's (llhttp is stopped here)

    def on_body(self, body: bytes) -> None:
        if not self._ended_at_head:
            self._events.append(body)

    def on_message_complete(self) -> None:
        self._in_message = False
        if not self._ended_at_head:
            self._events.append(END)

    # feeding ---------------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        if not data:
            self._eof = True
            return
        if self._error is not None or self._eof or self._ended_at_head:
            return
        if self._in_head or not self._in_message:
            self._head_bytes += len(data)
        try:
            self._llhttp.feed_data(data)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, _StopParsing):
                return
            self._error = ProtocolError(f"malformed HTTP: {exc}")
        except httptools.HttpParserUpgrade:
            self._error = ProtocolError("protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._error = ProtocolError(f"malformed HTTP: {exc}")
        else:
            if self._in_head and self._head_bytes > self._max_head:
                self._error = ProtocolError(f"HTTP head larger than {self._max_head} bytes", 431)

    def next_event(self) -> Event:
        if self._events:
            return self._events.popleft()
        if self._error is not None:
            raise self._error
        if self._eof:
            if not self._in_message or self._ended_at_head:
                return CLOSED
            if self._close_delimited and not self._in_head:
                self._in_message = False
                self._events.append(CLOSED)
                return END
            raise ProtocolError("the peer closed the connection mid-message")
        return NEED_DATA


class _StopParsing(Exception):
    pass


# writing ---------------------------------------------------------------------------------------


def _status_line(status: int, reason: bytes) -> bytes:
    if not reason:
        try:
            reason = HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b""
    return b"HTTP/1.1 %d %s\r\n" % (status, reason)


def encode_headers(headers: list[tuple[bytes, bytes]]) -> bytes:
    for name, value in headers:
        if b"\r" in name or b"\n" in name or b":" in name or b"\r" in value or b"\n" in value:
            raise FramingError(f"header {name!r} cannot be written")
    return b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)


class FramingError(Exception):
    """An answer that does not fit its own framing (more or fewer bytes than its length)."""


class BodyFraming:
    """How one outgoing message's body is written: by its length, chunked, or until close."""

    __slots__ = ("length", "chunked", "sent", "bodiless")

    def __init__(self, *, length: int | None, chunked: bool, bodiless: bool) -> None:
        self.length, self.chunked, self.bodiless, self.sent = length, chunked, bodiless, 0

    def data(self, data: bytes) -> bytes:
        if not data or self.bodiless:
            return b""
        self.sent += len(data)
        if self.length is not None and self.sent > self.length:
            raise FramingError(f"more body than its content-length ({self.length})")
        return b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data

    def end(self) -> bytes:
        if self.bodiless:
            return b""
        if self.length is not None and self.sent != self.length:
            raise FramingError(f"body of {self.sent} bytes, content-length {self.length}")
        return b"0\r\n\r\n" if self.chunked else b""


def response_head(request: Head, status: int, headers: list[tuple[bytes, bytes]],
                  reason: bytes = b"") -> tuple[bytes, BodyFraming, bool]:
    """The bytes of a response head to ``request``, its body's framing, and whether the
    connection stays open after it (h11's rules: see the module docstring)."""
    keep = request.keep_alive and request.http_version == "1.1"
    tokens = b",".join(v for k, v in headers if k == b"connection").lower()
    if b"close" in tokens:
        keep = False
    bodiless = request.method == b"HEAD" or status < 200 or status in (204, 304)
    length_value = next((v for k, v in headers if k == b"content-length"), None)
    length = int(length_value) if length_value is not None and length_value.isdigit() else None
    out = [(k, v) for k, v in headers if k != b"transfer-encoding"]
    chunked = False
    if status >= 200 and not bodiless and length is None:
        if request.http_version == "1.1":
            chunked = True
            out.append((b"transfer-encoding", b"chunked"))
        else:
            keep = False  # the body ends when the connection does
    if status >= 200 and not keep and b"close" not in tokens:
        out.append((b"connection", b"close"))
    framing = BodyFraming(length=length, chunked=chunked, bodiless=bodiless)
    return _status_line(status, reason) + encode_headers(out) + b"\r\n", framing, keep


def request_bytes(method: str, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    """A whole request (the proxy sends each one in one write): its own ``content-length``
    frames a body; a request without one has none."""
    return b"%s %s HTTP/1.1\r\n" % (method.encode("ascii"), target) + encode_headers(headers) + b"\r\n" + body
