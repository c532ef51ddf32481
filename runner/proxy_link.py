"""One connection from the daemon to its model proxy service (``runner.proxy_protocol``):
requests go out as they come, answers are matched to them by id, and a lost connection fails
every request waiting on it (``LinkClosed``) so the caller can re-attach."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import anyio
from anyio.streams.buffered import BufferedByteReceiveStream
from pydantic import ValidationError

from proxy.sockets import SocketStream, connect_unix
from runner.proxy_protocol import (
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
    read_line,
)

CALL_TIMEOUT_S = 30.0


class LinkClosed(Exception):
    """The connection to the service ended before the answer came."""


class ProxyServiceError(RuntimeError):
    """The service answered a request with an error."""


@dataclass
class _Waiting:
    done: anyio.Event = field(default_factory=anyio.Event)
    answer: AnswerLine | None = None


class ServiceLink:
    def __init__(self, stream: SocketStream) -> None:
        self._stream = stream
        self._buffered = BufferedByteReceiveStream(stream)
        self._next_id = 0
        self._waiting: dict[int, _Waiting] = {}
        self._write = anyio.Lock(fast_acquire=True)  # no yield when free: a call per turn phase
        self.closed = anyio.Event()

    async def read_answers(self) -> None:
        """Hand each answer to its request, until the connection ends."""
        try:
            while True:
                answer = AnswerLine.model_validate_json(await read_line(self._buffered))
                waiting = self._waiting.pop(answer.id, None)
                if waiting is not None:
                    waiting.answer = answer
                    waiting.done.set()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError,
                anyio.DelimiterNotFound, ValidationError):
            pass
        finally:
            self.closed.set()
            for waiting in self._waiting.values():
                waiting.done.set()  # no answer: LinkClosed
            self._waiting.clear()

    async def call(self, request: Request, timeout_s: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        """Send ``request``, wait for its answer (``TimeoutError`` after ``timeout_s``)."""
        if self.closed.is_set():
            raise LinkClosed
        self._next_id += 1
        ident, waiting = self._next_id, _Waiting()
        self._waiting[ident] = waiting
        try:
            async with self._write:
                await self._stream.send(encode(RequestLine(id=ident, request=request)))
            with anyio.fail_after(timeout_s):
                await waiting.done.wait()
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise LinkClosed from exc
        finally:
            self._waiting.pop(ident, None)
        if waiting.answer is None:
            raise LinkClosed
        if not waiting.answer.ok:
            raise ProxyServiceError(waiting.answer.error or "error")
        return waiting.answer.result

    async def hello(self, role: Literal["daemon", "operator"]) -> HelloResult:
        return HelloResult.model_validate(await self.call(Hello(role=role), timeout_s=10.0))

    async def stop(self, drain_s: float) -> None:
        await self.call(Stop(drain_s=drain_s))


@asynccontextmanager
async def linked(path: Path) -> AsyncIterator[ServiceLink]:
    """A link to the service listening at ``path`` (``OSError`` when none does), its answers
    read in a task of its own until the block ends."""
    stream = await connect_unix(path)
    link = ServiceLink(stream)
    failure: Exception | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(link.read_answers)
            try:
                yield link
            except Exception as exc:  # raised below, as itself (a task group would wrap it in a group)
                failure = exc
            finally:
                tg.cancel_scope.cancel()
    finally:
        await stream.aclose()
    if failure is not None:
        raise failure


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
