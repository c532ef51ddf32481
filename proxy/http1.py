"""The sandbox side of the proxy: one HTTP/1.1 server connection (parsed by llhttp, see
:mod:`proxy.framing`).

This module adds the bounds a hostile sandbox needs. Every read has a deadline, as a cancel
scope: an idle keep-alive connection, a request head that trickles in, a body that stalls.
Malformed HTTP gets a 400 (a head over its bound a 431) and the connection closes; nothing
here can raise past :meth:`ClientConnection.next_request` except cancellation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import anyio

from .framing import END, NEED_DATA, BodyFraming, FramingError, Head, Parser, ProtocolError, response_head
from .sockets import SocketStream

RECEIVE_SIZE = 64 * 1024


class ClientGone(Exception):
    """The sandbox closed the connection (or it broke) before the exchange ended."""


class BodyTooLarge(Exception):
    pass


class BodyTimeout(Exception):
    pass


class MalformedBody(Exception):
    pass


@dataclass(frozen=True)
class Limits:
    max_head_bytes: int = 256 * 1024  # Claude's anthropic-beta header alone is several KiB
    max_body_bytes: int = 32 << 20
    idle_timeout_s: float = 600.0  # keep-alive: the CLIs reuse connections between turns
    head_timeout_s: float = 30.0  # from the first byte of a request to the end of its head
    body_timeout_s: float = 60.0  # between two reads of a body
    write_timeout_s: float = 120.0  # one write to a sandbox that stopped reading


def error_body(status: int, kind: str, message: str) -> bytes:
    """The proxy's own error answer: readable by Anthropic and OpenAI clients alike."""
    return json.dumps({"type": "error", "error": {"type": kind, "code": kind, "message": message,
                                                  "status": status, "source": "cloud-agent-proxy"}}).encode()


class ClientConnection:
    def __init__(self, stream: SocketStream, limits: Limits) -> None:
        self.stream = stream
        self.limits = limits
        self.parser = Parser(request=True, max_head_bytes=limits.max_head_bytes)
        self.eof = False
        self.answered_error: str | None = None  # the proxy's own error answer on this connection
        self._held = bytearray()  # framed answer bytes not written yet (see hold_*)
        self._request: Head | None = None
        self._body_done = False  # the request's body was read to its end
        self._framing: BodyFraming | None = None  # the answer's, once its head is framed
        self._answered = False  # the answer was framed to its end
        self._keep = False
        self._expects_continue = False

    async def _receive(self) -> None:
        if self.eof:
            return
        try:
            data = await self.stream.receive(RECEIVE_SIZE)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            data = b""
        self.eof = not data
        self.parser.feed(data)

    @property
    def response_started(self) -> bool:
        return self._framing is not None

    # ---------------------------------------------------------------- requests

    async def next_request(self) -> Head | None:
        """The next request head; None when the connection should just close (clean EOF, idle
        timeout, or a malformed/slow request that was answered 400/408/431)."""
        try:
            event = self.parser.next_event()
            if event is NEED_DATA:
                with anyio.move_on_after(self.limits.idle_timeout_s) as idle:
                    await self._receive()
                if idle.cancelled_caught or self.eof:
                    return None  # idle keep-alive connection, or a clean close between requests
                with anyio.fail_after(self.limits.head_timeout_s):
                    while (event := self.parser.next_event()) is NEED_DATA:
                        await self._receive()
        except ProtocolError as exc:
            if self.eof:
                return None  # the peer went away mid-head: nobody to answer
            await self.answer_and_close(exc.status, "bad_request", f"malformed HTTP request: {exc}")
            return None
        except TimeoutError:
            await self.answer_and_close(408, "request_timeout",
                                        f"request head not complete within {self.limits.head_timeout_s:g}s")
            return None
        if not isinstance(event, Head):
            return None  # CLOSED
        self._request = event
        self._expects_continue = (event.http_version == "1.1"
                                  and (event.header(b"expect") or b"").lower() == b"100-continue")
        return event

    async def body(self) -> AsyncIterator[bytes]:
        """The request body as it arrives; raises BodyTooLarge, BodyTimeout, MalformedBody or
        ClientGone."""
        total = 0
        while True:
            try:
                event = self.parser.next_event()
            except ProtocolError as exc:
                if self.eof:
                    raise ClientGone("connection closed mid-body") from None
                raise MalformedBody(f"malformed request body: {exc}") from None
            if event is NEED_DATA:
                if self.eof:
                    raise ClientGone("connection closed mid-body")
                try:
                    with anyio.fail_after(self.limits.body_timeout_s):
                        await self._receive()
                except TimeoutError:
                    raise BodyTimeout(f"no body bytes for {self.limits.body_timeout_s:g}s") from None
                continue
            if isinstance(event, bytes):
                self._expects_continue = False
                total += len(event)
                if total > self.limits.max_body_bytes:
                    raise BodyTooLarge(f"request body larger than {self.limits.max_body_bytes} bytes")
                yield event
            elif event is END:
                self._body_done = True
                return
            else:
                raise ClientGone("connection closed mid-body")

    def watch_close(self, gone: Callable[[], None]) -> AbstractContextManager[None]:
        """While an answer streams: ``gone()`` once the sandbox closes its side (the exchange is
        abandoned). See :meth:`SocketStream.watch_close`."""
        if self.eof:
            gone()
        return self.stream.watch_close(gone)

    # ---------------------------------------------------------------- responses

    def hold_head(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"") -> None:
        """Frame a response head now and write it with the next flush: an answer's head and the
        body bytes that arrived with it go out in one write (one wake-up of the sandbox's reader)."""
        assert self._request is not None and self._framing is None
        head, self._framing, self._keep = response_head(self._request, status, headers, reason)
        self._expects_continue = False
        self._held += head

    def hold_data(self, data: bytes) -> None:
        assert self._framing is not None
        self._held += self._framing.data(data)

    def hold_end(self) -> None:
        assert self._framing is not None
        self._held += self._framing.end()
        self._answered = True

    async def flush(self) -> None:
        """Write whatever is held; the caller flushes before it waits for anything."""
        if not self._held:
            return
        data, self._held = bytes(self._held), bytearray()
        try:
            await self.stream.send(data)  # bounded by the stream's send timeout (Limits.write_timeout_s)
        except (TimeoutError, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ClientGone(f"sandbox stopped reading: {exc.__class__.__name__}") from None

    async def continue_100(self) -> None:
        if self._expects_continue:
            self._expects_continue = False
            self._held += b"HTTP/1.1 100 Continue\r\n\r\n"
            await self.flush()

    async def answer(self, status: int, kind: str, message: str, *, close: bool = False) -> int:
        """A complete JSON answer of the proxy's own; returns the body size."""
        body = error_body(status, kind, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await self.respond(status, headers, body)
        return len(body)

    async def respond(self, status: int, headers: list[tuple[bytes, bytes]], body: bytes, reason: bytes = b"") -> None:
        """A whole answer whose body is known, in one write."""
        self.hold_head(status, headers, reason)
        self.hold_data(body)
        self.hold_end()
        await self.flush()

    async def answer_and_close(self, status: int, kind: str, message: str) -> None:
        self.answered_error = kind
        if self._request is None:  # a request too malformed to have a head: answer as HTTP/1.1
            self._request = Head([], keep_alive=False)
        try:
            if not self.response_started:
                await self.answer(status, kind, message, close=True)
        except (ClientGone, FramingError):
            pass
        await self.close()

    # ---------------------------------------------------------------- lifecycle

    def reusable(self) -> bool:
        return self._answered and self._body_done and self._keep and not self.eof

    def next_cycle(self) -> None:
        self._request, self._framing = None, None
        self._body_done = self._answered = self._keep = self._expects_continue = False

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
