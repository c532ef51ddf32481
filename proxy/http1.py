"""The sandbox side of the proxy: one HTTP/1.1 server connection over a unix socket (h11).

h11 does the parsing (request line, headers, chunked and content-length bodies, keep-alive);
this module adds the bounds a hostile sandbox needs. Every read has a deadline, as a cancel
scope: an idle keep-alive connection, a request head that trickles in, a body that stalls.
Malformed HTTP gets a 400 and the connection closes; nothing here can raise past
:meth:`ClientConnection.next_request` except cancellation.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio
import h11

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
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_head_bytes)
        self.eof = False
        self.answered_error: str | None = None  # the proxy's own error answer on this connection
        self._held = bytearray()  # framed answer bytes not written yet (see hold)

    async def _receive(self) -> None:
        if self.eof:
            return
        try:
            data = await self.stream.receive(RECEIVE_SIZE)
        except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            data = b""
        self.eof = not data
        self.h11.receive_data(data)

    # ---------------------------------------------------------------- requests

    async def next_request(self) -> h11.Request | None:
        """The next request head; None when the connection should just close (clean EOF, idle
        timeout, or a malformed/slow request that was answered 400/408/431)."""
        try:
            event = self.h11.next_event()
            if event is h11.NEED_DATA:
                with anyio.move_on_after(self.limits.idle_timeout_s) as idle:
                    await self._receive()
                if idle.cancelled_caught or self.eof:
                    return None  # idle keep-alive connection, or a clean close between requests
                with anyio.fail_after(self.limits.head_timeout_s):
                    while (event := self.h11.next_event()) is h11.NEED_DATA:
                        await self._receive()
            return event if isinstance(event, h11.Request) else None  # else ConnectionClosed
        except h11.RemoteProtocolError as exc:
            if self.eof:
                return None  # the peer went away mid-head: nobody to answer
            await self.answer_and_close(exc.error_status_hint, "bad_request", f"malformed HTTP request: {exc}")
            return None
        except TimeoutError:
            await self.answer_and_close(408, "request_timeout",
                                        f"request head not complete within {self.limits.head_timeout_s:g}s")
            return None

    async def body(self) -> AsyncIterator[bytes]:
        """The request body as it arrives; raises BodyTooLarge, BodyTimeout, MalformedBody or
        ClientGone."""
        total = 0
        while True:
            try:
                event = self.h11.next_event()
            except h11.RemoteProtocolError as exc:
                if self.eof:
                    raise ClientGone("connection closed mid-body") from None
                raise MalformedBody(f"malformed request body: {exc}") from None
            if event is h11.NEED_DATA:
                if self.eof:
                    raise ClientGone("connection closed mid-body")
                try:
                    with anyio.fail_after(self.limits.body_timeout_s):
                        await self._receive()
                except TimeoutError:
                    raise BodyTimeout(f"no body bytes for {self.limits.body_timeout_s:g}s") from None
                continue
            if isinstance(event, h11.Data):
                total += len(event.data)
                if total > self.limits.max_body_bytes:
                    raise BodyTooLarge(f"request body larger than {self.limits.max_body_bytes} bytes")
                yield bytes(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return
            else:
                raise ClientGone("connection closed mid-body")

    async def peer_closed(self) -> bool:
        """While an answer streams: True once the sandbox closed its side (the exchange is
        abandoned); False when it sent bytes instead (kept for h11: the next request)."""
        if self.eof:
            return True
        await self._receive()
        return self.eof

    # ---------------------------------------------------------------- responses

    async def _send(self, event: h11.Event) -> None:
        self.hold(event)
        await self.flush()

    def hold(self, event: h11.Event) -> None:
        """Frame ``event`` now and write it with the next flush: an answer's head and the body
        bytes that arrived with it go out in one write (one wake-up of the sandbox's reader)."""
        self._held += self.h11.send(event) or b""

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
        if self.h11.they_are_waiting_for_100_continue:
            await self._send(h11.InformationalResponse(status_code=100, headers=[]))

    async def start_response(self, status: int, headers: list[tuple[bytes, bytes]], reason: bytes = b"") -> None:
        await self._send(h11.Response(status_code=status, headers=headers, reason=reason))

    async def send_data(self, data: bytes) -> None:
        if data:
            await self._send(h11.Data(data=data))

    async def end_response(self) -> None:
        await self._send(h11.EndOfMessage())

    async def answer(self, status: int, kind: str, message: str, *, close: bool = False) -> int:
        """A complete JSON answer of the proxy's own; returns the body size."""
        body = error_body(status, kind, message)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if close:
            headers.append((b"connection", b"close"))
        await self.start_response(status, headers)
        await self.send_data(body)
        await self.end_response()
        return len(body)

    async def answer_and_close(self, status: int, kind: str, message: str) -> None:
        self.answered_error = kind
        try:
            if self.h11.our_state in (h11.IDLE, h11.SEND_RESPONSE):
                await self.answer(status, kind, message, close=True)
        except (ClientGone, h11.LocalProtocolError):
            pass
        await self.close()

    # ---------------------------------------------------------------- lifecycle

    def reusable(self) -> bool:
        return self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE

    def next_cycle(self) -> None:
        self.h11.start_next_cycle()

    async def close(self) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.stream.aclose()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                pass
