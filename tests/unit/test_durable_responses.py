"""A turn's commit is flushed by the store's flusher after its COMMIT (state.store's
``settle_job``), and no response of the daemon starts or ends before it is on disk
(runner.durable_responses).

Real parts: the store's SQLite file and its flusher process, held with SIGSTOP so the flush
stays pending for as long as the test looks.
"""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
import httpx
import pytest
from pydantic import SecretStr
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Message

from runner.daemon import Api, create_app
from runner.durable_responses import DurableResponses
from runner.job_response import JobResponse
from runner.job_stream import JobStream, ndjson_line
from state.records import JobState
from state.store import Store
from state.wire_ledger import SettleQuery
from tests.support.fake_engine import RefusingEngine
from tests.unit.test_inspector_api import AUTH, TOKEN, receipt, supervisor

pytestmark = pytest.mark.anyio


@pytest.fixture
async def store(sqlite_store: Store) -> AsyncIterator[Store]:
    await sqlite_store.open()
    assert sqlite_store.flusher is not None and sqlite_store.flusher.pid is not None
    yield sqlite_store


@contextmanager
def flusher_held(store: Store) -> Iterator[None]:
    """The flusher process stopped: a flush asked for meanwhile is answered once it goes on."""
    assert store.flusher is not None and store.flusher.pid is not None
    os.kill(store.flusher.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(store.flusher.pid, signal.SIGCONT)


async def claimed(store: Store, job_id: str) -> None:
    assert (await store.claim_job(job_id, "u1", "c1", "m1", "d", "o", sync=False)).kind == "claimed"
    await store.sync()


async def settle(store: Store, job_id: str) -> None:
    await store.settle_job("u1", job_id, SettleQuery("c1", None), lambda view: (receipt(job_id), None))


async def until_done(store: Store, job_id: str) -> None:
    """Until the store's thread serves a read that sees the job's receipt."""
    while (job := await store.get_job("u1", job_id)) is None or job.state != JobState.DONE:
        await anyio.sleep(0.005)


async def test_a_turns_commit_frees_the_stores_thread_and_returns_once_flushed(store: Store) -> None:
    """The COMMIT does not fsync on the store's thread: another call is served while the flush
    is pending, and the commit returns only once the flusher answered. (A synchronous commit
    fsyncs by itself: it returns while the flusher is stopped.)"""
    await claimed(store, "j1")
    assert store.flusher is not None
    flushes = store.flusher.flushes
    returned = anyio.Event()

    async def settling() -> None:
        await settle(store, "j1")
        returned.set()

    async with anyio.create_task_group() as tg:
        with flusher_held(store):
            tg.start_soon(settling)
            with anyio.fail_after(10):
                await until_done(store, "j1")  # committed, visible, and the thread is free
            assert not returned.is_set()
            assert store.flusher.flushes == flushes  # asked for, not answered
        with anyio.fail_after(10):
            await returned.wait()
    assert store.flusher.flushes == flushes + 1


async def test_no_response_starts_before_the_commits_it_may_show_are_on_disk(store: Store) -> None:
    """The inspector reads a receipt committed but not yet flushed: its answer waits for the
    flush (without the middleware it goes at once, receipt and all)."""
    await claimed(store, "j1")
    api = Api(supervisor(store), SecretStr(TOKEN), max_message_bytes=1000)
    syncing = anyio.Event()
    real_sync = store.sync

    async def spied_sync() -> None:
        syncing.set()
        await real_sync()

    answer: list[Any] = []
    async with (httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(api)), base_url="http://daemon") as c,
                anyio.create_task_group() as tg):

        async def get_turns() -> None:
            answer.append(await c.get("/v1/users/u1/chats/c1/turns", headers=AUTH))

        with flusher_held(store):
            tg.start_soon(settle, store, "j1")
            with anyio.fail_after(10):
                await until_done(store, "j1")
            store.sync = spied_sync  # type: ignore[method-assign]
            tg.start_soon(get_turns)
            with anyio.move_on_after(2):
                await syncing.wait()  # the handler read the receipt; its response is starting
            await anyio.sleep(0.2)  # long enough for an answer that did not wait to arrive
            assert answer == [] and syncing.is_set()
        with anyio.fail_after(10):
            while not answer:
                await anyio.sleep(0.005)
    assert answer[0].status_code == 200
    turns = answer[0].json()["turns"]
    assert [(t["job_id"], t["state"], t["receipt"]["outcome"]) for t in turns] == [("j1", "done", "succeeded")]


async def test_a_turns_stream_ends_with_its_receipt_only_once_the_commit_is_on_disk(store: Store) -> None:
    """The turn's commit returns before its flush (``sync=False``: the receipt is framed
    meanwhile); the job stream's events go out at once, its last line only once the flush
    answered (without the wait at the body's end: at once)."""
    await claimed(store, "j1")
    stream = JobStream(1 << 20)

    async def job(request: Request) -> Response:
        return JobResponse(stream)

    app = Starlette(routes=[Route("/job", job)], middleware=[Middleware(DurableResponses, store=store)])
    sent: list[Message] = []
    scope = {"type": "http", "http_version": "1.1", "method": "GET", "path": "/job", "raw_path": b"/job",
             "root_path": "", "scheme": "http", "query_string": b"", "headers": [], "server": ("daemon", 80),
             "client": ("127.0.0.1", 1)}

    async def receive() -> Message:
        await anyio.sleep_forever()
        raise AssertionError

    async def send(message: Message) -> None:
        sent.append(message)

    def bodies() -> list[tuple[bytes, bool]]:
        return [(m["body"], m.get("more_body", False)) for m in sent if m["type"] == "http.response.body"]

    async def until(check: Callable[[], bool]) -> None:
        with anyio.fail_after(10):
            while not check():
                await anyio.sleep(0.005)

    event, last = {"type": "event", "n": 1}, {"type": "receipt", "job_id": "j1"}
    async with anyio.create_task_group() as tg:
        tg.start_soon(app, scope, receive, send)
        stream.emit(event)
        await until(lambda: bodies() == [(ndjson_line(event), True)])
        with flusher_held(store):
            with anyio.fail_after(10):  # returns with its flush pending
                await store.settle_job("u1", "j1", SettleQuery("c1", None), lambda view: (receipt("j1"), None),
                                       sync=False)
            assert (await store.get_job("u1", "j1")).state == JobState.DONE
            stream.finish(last)
            await anyio.sleep(0.2)  # long enough for a last line that did not wait to go out
            assert bodies() == [(ndjson_line(event), True)]
        await until(lambda: len(bodies()) == 2)
    assert bodies() == [(ndjson_line(event), True), (ndjson_line(last), False)]


async def test_a_store_closes_once_a_turns_commit_still_in_flight_is_on_disk(store: Store) -> None:
    await claimed(store, "j1")
    assert store.flusher is not None
    flushes = store.flusher.flushes
    closed = anyio.Event()

    async def closing() -> None:
        await store.aclose()
        closed.set()

    async with anyio.create_task_group() as tg:
        with flusher_held(store):
            await store.settle_job("u1", "j1", SettleQuery("c1", None), lambda view: (receipt("j1"), None), sync=False)
            tg.start_soon(closing)
            await anyio.sleep(0.2)  # long enough for a close that did not wait
            assert not closed.is_set()
        with anyio.fail_after(10):
            await closed.wait()
    assert store.flusher.flushes == flushes + 1


async def test_the_supervisors_shutdown_waits_for_a_commit_still_on_its_way_to_the_disk(tmp_path) -> None:
    """A turn whose reader left has no response to wait for its commit's flush: the shutdown
    does (without: it ends with the flush still unanswered)."""
    from runner.config import load_settings
    from runner.supervisor import build_supervisor
    from tests import daemon_harness

    settings = load_settings({"CLOUD_AGENT_HOME": str(tmp_path), "CLOUD_AGENT_SOCKET_DIR":
                              daemon_harness.test_socket_dir(tmp_path), "CLOUD_AGENT_IMAGE": "fake:1",
                              "CLOUD_AGENT_GATEWAY_URL": "http://127.0.0.1:9", "CLOUD_AGENT_PROXY_PROCESS": "daemon"})
    sup = build_supervisor(settings, "http://127.0.0.1:9", engine=RefusingEngine())  # type: ignore[arg-type]
    store = sup.store
    assert isinstance(store, Store)
    stopped = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            running = anyio.Event()
            leave = anyio.Event()

            async def serve() -> None:
                async with sup.running():
                    running.set()
                    await leave.wait()
                stopped.set()

            tg.start_soon(serve)
            with anyio.fail_after(30):
                await running.wait()
            await claimed(store, "j1")
            flushes = store.flusher.flushes
            with flusher_held(store):
                await store.settle_job("u1", "j1", SettleQuery("c1", None), lambda view: (receipt("j1"), None),
                                       sync=False)
                leave.set()
                await anyio.sleep(0.5)  # long enough for a shutdown that did not wait to end
                assert not stopped.is_set()
            with anyio.fail_after(30):
                await stopped.wait()
            assert store.flusher.flushes == flushes + 1
    finally:
        store.close()
