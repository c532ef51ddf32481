"""One connection from the daemon to its model proxy service (``runner.proxy_protocol``):
requests go out as they come, answers are matched to them by id, and a lost connection fails
every request waiting on it (``LinkClosed``) so the caller can re-attach.

The connection is a transport of the event loop's own, and each answer is handed to its request
as its line arrives, in the transport's callback. A turn makes two calls (its begin and its
flush): on anyio's buffered socket stream, each answer woke a reader task, which re-registered
the socket with the loop for every read that found nothing, parsed the line and set the
caller's event, and each call's send was a checkpoint of its own (the same costs as the keeper
link's, sandbox_manager.keeper_link)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, cast

import anyio
from pydantic import ValidationError

from runner.proxy_protocol import (
    MAX_LINE_BYTES,
    AnswerLine,
    Begin,
    Close,
    End,
    Flush,
    Hello,
    HelloResult,
    KeepTurns,
    Member,
    Metrics,
    MetricsResult,
    Open,
    OpenResult,
    Request,
    RequestLine,
    Stop,
    encode,
)

CALL_TIMEOUT_S = 30.0


class LinkClosed(Exception):
    """The connection to the service ended before the answer came."""


class ProxyServiceError(RuntimeError):
    """The service answered a request with an error."""


class _Answers(asyncio.Protocol):
    """The connection's side on the loop: its lines, each an answer for a waiting request."""

    def __init__(self, link: ServiceLink) -> None:
        self.link = link
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's does not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        try:
            while (end := buffer.find(b"\n", start)) >= 0:
                self.link._answered(AnswerLine.model_validate_json(buffer[start:end]))
                start = end + 1
        except ValidationError:
            self._end()  # not the protocol: nothing it says can be trusted
            return
        del buffer[:start]
        if len(buffer) > MAX_LINE_BYTES:
            self._end()

    def eof_received(self) -> bool:
        return False  # the transport closes itself: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.link._lost()

    def _end(self) -> None:
        self._buffer.clear()
        if self.transport is not None:
            self.transport.abort()


class ServiceLink:
    def __init__(self, answers: _Answers | None = None) -> None:
        self._answers = answers
        self._next_id = 0
        self._waiting: dict[int, asyncio.Future[AnswerLine | None]] = {}
        self.closed = anyio.Event()

    @classmethod
    async def connect(cls, path: Path) -> ServiceLink:
        """Connected to the service listening at ``path`` (``OSError`` when none does)."""
        link = cls()
        _, link._answers = await asyncio.get_running_loop().create_unix_connection(lambda: _Answers(link), str(path))
        return link

    def _answered(self, answer: AnswerLine) -> None:
        waiting = self._waiting.pop(answer.id, None)
        if waiting is not None and not waiting.done():
            waiting.set_result(answer)

    def _lost(self) -> None:
        self.closed.set()
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_result(None)  # no answer: LinkClosed
        self._waiting.clear()

    async def call(self, request: Request, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """Send ``request``, wait for its answer (``TimeoutError`` after ``timeout_s``)."""
        transport = self._answers.transport if self._answers is not None else None
        if self.closed.is_set() or transport is None or transport.is_closing():
            raise LinkClosed
        self._next_id += 1
        ident = self._next_id
        waiting: asyncio.Future[AnswerLine | None] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = waiting
        try:
            transport.write(encode(RequestLine(id=ident, request=request)))  # whole, in the order of the calls
            with anyio.fail_after(timeout_s):
                answer = await waiting
        finally:
            self._waiting.pop(ident, None)
        if answer is None:
            raise LinkClosed
        if not answer.ok:
            raise ProxyServiceError(answer.error or "error")
        return answer.result

    async def hello(self, role: Literal["daemon", "operator"]) -> HelloResult:
        return HelloResult.model_validate(await self.call(Hello(role=role), timeout_s=10.0))

    async def stop(self, drain_s: float) -> None:
        await self.call(Stop(drain_s=drain_s))

    def close(self) -> None:
        if self._answers is not None and self._answers.transport is not None:
            self._answers.transport.close()  # what was written goes first
        self._lost()


@asynccontextmanager
async def linked(path: Path) -> AsyncIterator[ServiceLink]:
    """A link to the service listening at ``path`` (``OSError`` when none does) until the block
    ends."""
    link = await ServiceLink.connect(path)
    try:
        yield link
    finally:
        link.close()


class LinkOps:
    """The :class:`runner.model_proxy.ProxyOps` of one link: each operation one request."""

    def __init__(self, link: ServiceLink) -> None:
        self.link = link

    async def open(self, chat_key: str, user_id: str, chat_id: str, directory: Path) -> Path:
        result = await self.link.call(Open(chat_key=chat_key, user_id=user_id, chat_id=chat_id, directory=directory))
        return OpenResult.model_validate(result).path

    async def close(self, chat_key: str) -> None:
        await self.link.call(Close(chat_key=chat_key))

    async def flush(self, chat_key: str, timeout_s: float, end_of: tuple[str, str] | None = None) -> None:
        await self.link.call(Flush(chat_key=chat_key, timeout_s=timeout_s, end_of=end_of),
                             timeout_s=timeout_s + CALL_TIMEOUT_S)

    async def member(self, chat_key: str, member_key: str, member_id: str) -> None:
        await self.link.call(Member(chat_key=chat_key, member_key=member_key, member_id=member_id))

    async def begin(self, chat_key: str, member_key: str, member_id: str, job_id: str) -> None:
        await self.link.call(Begin(chat_key=chat_key, member_key=member_key, member_id=member_id, job_id=job_id))

    async def end(self, chat_key: str, member_key: str, job_id: str) -> None:
        await self.link.call(End(chat_key=chat_key, member_key=member_key, job_id=job_id))

    async def keep_turns(self, job_ids: list[str]) -> None:
        await self.link.call(KeepTurns(job_ids=job_ids))

    async def metrics(self) -> MetricsResult:
        return MetricsResult.model_validate(await self.link.call(Metrics()))
