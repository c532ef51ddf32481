"""runner.proxy_link: the daemon's connection to its model proxy service, answers matched to
requests by id as their lines arrive."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from proxy.sockets import SocketStream, UnixListener
from runner.proxy_link import LinkClosed, ProxyServiceError, linked
from runner.proxy_protocol import (
    AnswerLine,
    Close,
    RequestLine,
    Stop,
    encode,
    parse_request,
)

pytestmark = pytest.mark.anyio


@asynccontextmanager
async def service(script: Callable[[SocketStream], Awaitable[None]]) -> AsyncIterator[Path]:
    """A peer on a unix socket that plays ``script`` on the first connection."""
    path = Path(tempfile.mkdtemp(prefix="ca-pl-", dir="/tmp")) / "c.sock"
    listener = UnixListener(path, 0o600)
    try:
        async with anyio.create_task_group() as tg:
            async def serve() -> None:
                stream = await listener.accept()
                try:
                    await script(stream)
                finally:
                    await stream.aclose()

            tg.start_soon(serve)
            yield path
            tg.cancel_scope.cancel()
    finally:
        listener.close()
        shutil.rmtree(path.parent, ignore_errors=True)


async def requests(stream: SocketStream, n: int) -> list[RequestLine]:
    data = b""
    while data.count(b"\n") < n:
        data += await stream.receive()
    return [parse_request(line) for line in data.splitlines()]


def answer(ident: int, **result: object) -> bytes:
    return encode(AnswerLine(id=ident, ok=True, result=dict(result)))


async def test_answers_reach_their_requests_in_any_order_and_any_cut() -> None:
    async def script(stream: SocketStream) -> None:
        got = await requests(stream, 3)
        assert [r.id for r in got] == [1, 2, 3]  # in the order the calls were made
        # the third and the first answers in one write, the second cut in two
        await stream.send(answer(3, n="three") + answer(1, n="one"))
        second = answer(2, n="two")
        await stream.send(second[:7])
        await anyio.sleep(0.05)
        await stream.send(second[7:])
        await anyio.sleep(5)

    got: dict[str, dict[str, object]] = {}
    async with service(script) as path, linked(path) as link:
        async def call(name: str) -> None:
            got[name] = await link.call(Close(chat_key=name), timeout_s=5)

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                for name in ("a", "b", "c"):
                    tg.start_soon(call, name)
                    await anyio.sleep(0.01)  # a, b, c get ids 1, 2, 3
    assert got == {"a": {"n": "one"}, "b": {"n": "two"}, "c": {"n": "three"}}


async def test_an_error_answer_is_raised_and_the_link_goes_on() -> None:
    async def script(stream: SocketStream) -> None:
        (first,) = await requests(stream, 1)
        await stream.send(encode(AnswerLine(id=first.id, ok=False, error="no such chat")))
        (second,) = await requests(stream, 1)
        await stream.send(answer(second.id, fine=True))
        await anyio.sleep(5)

    async with service(script) as path, linked(path) as link:
        with anyio.fail_after(5):
            with pytest.raises(ProxyServiceError, match="no such chat"):
                await link.call(Close(chat_key="x"))
            assert await link.call(Close(chat_key="y")) == {"fine": True}
        assert not link.closed.is_set()


async def test_a_line_that_is_not_an_answer_ends_the_link_and_its_waiting_requests() -> None:
    async def script(stream: SocketStream) -> None:
        await requests(stream, 1)
        await stream.send(b'{"id": "one", "ok": "perhaps"}\n')
        await anyio.sleep(5)

    async with service(script) as path, linked(path) as link:
        with anyio.fail_after(5):
            with pytest.raises(LinkClosed):
                await link.call(Stop(drain_s=0))
            await link.closed.wait()
        with pytest.raises(LinkClosed):
            await link.call(Stop(drain_s=0))


async def test_a_request_nobody_answers_times_out_and_a_late_answer_is_dropped() -> None:
    async def script(stream: SocketStream) -> None:
        first, = await requests(stream, 1)
        await anyio.sleep(0.3)
        await stream.send(answer(first.id, late=True))
        (second,) = await requests(stream, 1)
        await stream.send(answer(second.id, on_time=True))
        await anyio.sleep(5)

    async with service(script) as path, linked(path) as link:
        with pytest.raises(TimeoutError):
            await link.call(Close(chat_key="x"), timeout_s=0.1)
        with anyio.fail_after(5):
            assert await link.call(Close(chat_key="y")) == {"on_time": True}
