"""DockerEngine never blocks the event loop: constructing it touches no socket, and every SDK
call (the API-version negotiation of the client, a container's create with the SDK's inspect of
it) runs in a worker thread."""

from __future__ import annotations

import threading

import anyio
import docker
import pytest

from sandbox_manager.engine import ContainerSpec, DockerEngine

pytestmark = pytest.mark.anyio

CALLS: list[tuple[str, bool]] = []  # (what, ran on the event-loop thread)


def record(what: str) -> None:
    CALLS.append((what, threading.current_thread() is threading.main_thread()))


class FakeContainer:
    id = "c" * 64
    name = "sb"
    status = "created"

    def __init__(self) -> None:
        self.attrs: dict = {"Id": self.id, "Name": "/sb", "State": {"Status": "created"}, "Image": "sha256:img",
                            "Config": {"Labels": {"k": "v"}}}  # the engine's inspect document, as the SDK keeps it

    def reload(self) -> None:
        record("reload")


class FakeContainers:
    def create(self, **kwargs: object) -> FakeContainer:
        record("create")  # the SDK's create is the API's create, then an inspect of what it made
        return FakeContainer()


class FakeEvents:
    def __init__(self, events: list[dict]) -> None:
        self.events, self.closed = events, False

    def __iter__(self):
        return iter(self.events)

    def close(self) -> None:
        self.closed = True


class FakeApi:
    def events(self, *, decode: bool, filters: dict) -> FakeEvents:
        record(f"events decode={decode} filters={sorted(filters)}")
        return FakeEvents([{"Action": "die", "id": "c1"}, {"Action": "start", "id": "c2"}])


class FakeClient:
    def __init__(self, base_url: str, timeout: int) -> None:
        record("negotiate")  # the real client asks the engine for its API version here
        self.containers = FakeContainers()
        self.api = FakeApi()

    def close(self) -> None:
        pass


@pytest.fixture
def fake_sdk(monkeypatch):
    CALLS.clear()
    monkeypatch.setattr(docker, "DockerClient", FakeClient)


async def test_construction_is_cheap_and_calls_run_in_worker_threads(fake_sdk) -> None:
    engine = DockerEngine("unix:///nowhere/docker.sock")
    assert CALLS == []  # nothing touched the socket yet
    info = await engine.create(ContainerSpec(image="img", name="sb", labels={}))
    assert info.labels == {"k": "v"}  # the create's own inspect: not inspected again
    assert CALLS == [("negotiate", False), ("create", False)]
    engine.close()


async def test_an_engine_that_is_down_is_reported_not_raised_at_construction(tmp_path) -> None:
    engine = DockerEngine(f"unix://{tmp_path}/missing.sock", timeout_s=2)
    assert await engine.ping() is False
    engine.close()


async def test_the_event_stream_is_opened_in_a_worker_thread_and_read_to_its_end(fake_sdk) -> None:
    engine = DockerEngine("unix:///nowhere/docker.sock")
    async with engine.follow_events({"type": ["container"]}) as events:
        got = [e async for e in events]
    assert got == [{"Action": "die", "id": "c1"}, {"Action": "start", "id": "c2"}]
    assert CALLS == [("negotiate", False), ("events decode=True filters=['type']", False)]
    engine.close()


class BlockingEvents:
    """An engine event stream that gives its events, then blocks in its read until closed (as the
    SDK's does on a live connection); the read that close wakes ends the stream."""

    def __init__(self, events: list[dict]) -> None:
        self.events, self.closed = list(events), threading.Event()

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.events:
            return self.events.pop(0)
        self.closed.wait(10)
        raise OSError("the stream's socket was shut down")

    def close(self) -> None:
        self.closed.set()


async def test_the_event_reader_never_waits_on_the_event_loop(monkeypatch) -> None:
    """The worker thread that reads the stream must not call back into the loop: a read woken by
    close after the loop stopped would wait for ever on it, and that non-daemon thread kept the
    test process (and a daemon at SIGTERM) from exiting."""
    stream = BlockingEvents([{"Action": "die", "id": "c1"}, {"Action": "start", "id": "c2"}])
    monkeypatch.setattr(docker, "DockerClient", FakeClient)
    monkeypatch.setattr(FakeApi, "events", lambda self, decode, filters: stream)
    called_back: list[str] = []
    real_run_sync = anyio.from_thread.run_sync
    monkeypatch.setattr(anyio.from_thread, "run_sync",
                        lambda func, *a, **k: (called_back.append(getattr(func, "__name__", "?")),
                                               real_run_sync(func, *a, **k))[1])
    engine = DockerEngine("unix:///nowhere/docker.sock")
    got: list[dict] = []
    with anyio.move_on_after(1) as scope:
        async with engine.follow_events({"type": ["container"]}) as events:
            async for event in events:
                got.append(event)
    assert scope.cancelled_caught  # the stream stayed open until the block was left
    assert got == [{"Action": "die", "id": "c1"}, {"Action": "start", "id": "c2"}]
    assert stream.closed.is_set()
    assert called_back == []
    engine.close()
