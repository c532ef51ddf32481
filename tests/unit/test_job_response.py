"""The job's NDJSON response: its last chunk carries the response's end (one write, issue 16)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from runner.job_response import JobResponse
from runner.job_stream import JobStream, ndjson_line

pytestmark = pytest.mark.anyio

RECEIPT = {"type": "receipt", "receipt": {"job_id": "j1"}}
SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "path": "/v1/jobs", "headers": []}


def event(i: int) -> dict[str, object]:
    return {"type": "event", "kind": "text", "text": f"delta {i}"}


async def respond(stream: JobStream, produce: Any) -> list[dict[str, Any]]:
    """The ASGI messages the response sends while ``produce`` feeds ``stream``."""
    sent: list[dict[str, Any]] = []
    never = anyio.Event()

    async def receive() -> dict[str, Any]:
        await never.wait()  # the client stays
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(produce)
        await JobResponse(stream)(SCOPE, receive, send)
    return sent


def bodies(sent: list[dict[str, Any]]) -> list[tuple[bytes, bool]]:
    return [(m["body"], m["more_body"]) for m in sent if m["type"] == "http.response.body"]


async def test_the_receipt_line_ends_the_response_in_the_same_message() -> None:
    stream = JobStream(budget_bytes=10_000)

    async def produce() -> None:
        stream.emit(event(0))
        await anyio.sleep(0.01)
        stream.emit(event(1))
        await anyio.sleep(0.01)
        stream.finish(RECEIPT)

    sent = await respond(stream, produce)
    assert sent[0]["type"] == "http.response.start"
    assert sent[0]["status"] == 200
    assert (b"content-type", b"application/x-ndjson") in sent[0]["headers"]
    assert bodies(sent) == [(ndjson_line(event(0)), True), (ndjson_line(event(1)), True),
                            (ndjson_line(RECEIPT), False)]


async def test_lines_queued_with_the_receipt_go_in_its_message() -> None:
    stream = JobStream(budget_bytes=10_000)

    async def produce() -> None:
        stream.emit(event(0))
        stream.finish(RECEIPT)

    sent = await respond(stream, produce)
    assert bodies(sent) == [(ndjson_line(event(0)) + ndjson_line(RECEIPT), False)]


async def test_a_client_that_leaves_cancels_the_response_and_the_stream_keeps_nothing() -> None:
    stream = JobStream(budget_bytes=10_000)
    sent: list[dict[str, Any]] = []
    left = anyio.Event()

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        if message["type"] == "http.response.body":
            left.set()  # the client goes after the first line

    stream.emit(event(0))
    with anyio.fail_after(5):
        await JobResponse(stream)(SCOPE, receive, send)
    assert bodies(sent) == [(ndjson_line(event(0)), True)]
    stream.emit(event(1))
    stream.finish(RECEIPT)
    assert stream.buffered_bytes == 0  # the turn goes on; nothing is kept for nobody
