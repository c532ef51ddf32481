"""DockerEngine never blocks the event loop: constructing it touches no socket, and every SDK
call (the API-version negotiation of the client, a container's create and its reload) runs in a
worker thread."""

from __future__ import annotations

import threading

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
        self.attrs: dict = {"State": {"Status": "created"}, "Image": "sha256:img", "Config": {"Labels": {}}}

    def reload(self) -> None:
        record("reload")
        self.attrs = {"State": {"Status": "created"}, "Image": "sha256:img", "Config": {"Labels": {"k": "v"}}}


class FakeContainers:
    def create(self, **kwargs: object) -> FakeContainer:
        record("create")
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
    assert info.labels == {"k": "v"}  # the reloaded attributes
    assert CALLS == [("negotiate", False), ("create", False), ("reload", False)]
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
