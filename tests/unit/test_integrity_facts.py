"""Event-fed integrity facts (issue 16): kept only while the engine's event stream is live,
dropped by every event that could change them, never kept from a check that raced one."""

from __future__ import annotations

import math
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest

from sandbox_manager.engine import DATA_ROOT_VOLUME, ContainerInfo, ImageInfo
from sandbox_manager.integrity import Facts, IntegrityFacts

pytestmark = pytest.mark.anyio


class FakeEvents:
    """An engine whose event stream the test feeds (and ends) by hand."""

    def __init__(self) -> None:
        self.connections = 0
        self.send: Any = None
        self.connected = anyio.Event()

    @asynccontextmanager
    async def follow_events(self, filters: dict[str, list[str]]):
        assert filters == {"type": ["container", "image", "volume", "daemon"]}
        send, receive = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
        self.send = send
        self.connections += 1
        self.connected.set()
        async with receive:
            yield receive

    async def emit(self, kind: str, action: str, actor: str, at_ns: int | None = None) -> None:
        event: dict[str, Any] = {"Type": kind, "Action": action, "Actor": {"ID": actor}}
        if at_ns is not None:
            event["timeNano"] = at_ns
        await self.send.send(event)
        await anyio.wait_all_tasks_blocked()

    async def end(self) -> None:
        self.connected = anyio.Event()
        await self.send.aclose()
        await anyio.wait_all_tasks_blocked()


def facts(cid: str = "c1", image: str = "sha256:img", status: str = "running", volume: str | None = None) -> Facts:
    return Facts(ContainerInfo(id=cid, name=f"ca-{cid}", status=status, image_id=image, labels={}),
                 ImageInfo(id=image, labels={}, tags=()), "root-1", volume)


async def checked(cache: IntegrityFacts, cid: str = "c1", **kw: Any) -> None:
    cache.put(cache.token(cid), facts(cid, **kw))


@pytest.fixture
async def live():
    engine = FakeEvents()
    cache = IntegrityFacts(engine, reconnect_s=0.01)  # type: ignore[arg-type]
    async with anyio.create_task_group() as tg:
        tg.start_soon(cache.follow)
        await engine.connected.wait()
        await anyio.wait_all_tasks_blocked()
        yield cache, engine
        tg.cancel_scope.cancel()


async def test_nothing_is_kept_without_a_stream() -> None:
    cache = IntegrityFacts(object())  # type: ignore[arg-type]
    assert cache.token("c1") is None
    await checked(cache)
    assert cache.get("c1", "root-1") is None
    await cache.follow()  # an engine without events: returns at once, nothing ever kept
    assert not cache.live


async def test_kept_while_live_and_only_for_the_recorded_data_root(live) -> None:
    cache, _ = live
    await checked(cache)
    assert cache.get("c1", "root-1") == facts()
    assert cache.get("c1", "another-root") is None
    assert cache.get("c2", "root-1") is None
    await checked(cache, "c3", status="exited")
    assert cache.get("c3", "root-1") is None  # a stopped container is never answered from facts


async def test_own_exec_traffic_keeps_facts_and_every_other_container_event_drops_them(live) -> None:
    cache, engine = live
    await checked(cache)
    await checked(cache, "c2")
    for action in ("exec_create: sh -c true", "exec_start: sh -c true", "exec_die", "attach", "extract-to-dir"):
        await engine.emit("container", action, "c1")
    assert cache.get("c1", "root-1") is not None
    for action in ("die", "destroy", "stop", "kill", "pause", "rename", "update", "oom"):
        await checked(cache)
        await engine.emit("container", action, "c1")
        assert cache.get("c1", "root-1") is None, action
    assert cache.get("c2", "root-1") is not None  # another container's facts stay


async def test_a_containers_own_create_and_start_keep_the_facts_its_creation_stores(live) -> None:
    cache, engine = live
    token = cache.token("c1")  # taken when the creating start returned; its events come later
    for action in ("create", "start"):
        await engine.emit("container", action, "c1")
    cache.put(token, facts())
    assert cache.get("c1", "root-1") == facts()


async def test_a_container_started_again_after_a_stop_has_no_facts_until_checked(live) -> None:
    cache, engine = live
    await checked(cache)
    token = cache.token("c1")  # a check under way while the container stops
    await engine.emit("container", "die", "c1")
    await engine.emit("container", "start", "c1")
    cache.put(token, facts())
    assert cache.get("c1", "root-1") is None
    await checked(cache)  # a check after the restart keeps its facts
    assert cache.get("c1", "root-1") == facts()


@pytest.mark.parametrize("event", [("image", "delete", "sha256:img"), ("image", "untag", "sha256:other"),
                                   ("volume", "destroy", DATA_ROOT_VOLUME), ("volume", "create", DATA_ROOT_VOLUME),
                                   ("daemon", "reload", "engine")])
async def test_image_data_root_and_daemon_events_drop_everything(live, event) -> None:
    cache, engine = live
    await checked(cache)
    await checked(cache, "c2", image="sha256:two")
    await engine.emit(*event)
    assert (cache.get("c1", "root-1"), cache.get("c2", "root-1")) == (None, None)


async def test_other_volumes_and_image_pulls_change_nothing(live) -> None:
    cache, engine = live
    await checked(cache)
    await engine.emit("volume", "destroy", "some-other-volume")
    await engine.emit("image", "tag", "sha256:img")
    assert cache.get("c1", "root-1") is not None


async def test_a_state_volume_removed_or_made_anew_drops_its_containers_facts(live) -> None:
    cache, engine = live
    await checked(cache, "c1", volume="ca-c1-home")
    await checked(cache, "c2", volume="ca-c2-home")
    await engine.emit("volume", "mount", "ca-c1-home")  # the container's own start: nothing
    await engine.emit("volume", "unmount", "ca-c1-home")
    assert cache.get("c1", "root-1") is not None
    for action in ("destroy", "create"):
        await checked(cache, "c1", volume="ca-c1-home")
        await engine.emit("volume", action, "ca-c1-home")
        assert cache.get("c1", "root-1") is None, action
    assert cache.get("c2", "root-1") is not None  # another chat's volume: its facts stay


async def test_a_check_that_raced_an_event_is_not_kept(live) -> None:
    cache, engine = live
    token = cache.token("c1")
    await engine.emit("container", "die", "c1")  # while the check was running
    cache.put(token, facts())
    assert cache.get("c1", "root-1") is None
    token = cache.token("c1")
    await engine.emit("image", "delete", "sha256:whatever")
    cache.put(token, facts())
    assert cache.get("c1", "root-1") is None


async def test_a_destroyed_container_leaves_nothing_behind_and_no_check_of_it_is_kept(live) -> None:
    cache, engine = live
    for n in range(10):  # containers come and go: their counters must not pile up
        cid = f"gone-{n}"
        await checked(cache, cid)
        await engine.emit("container", "die", cid)
        await engine.emit("container", "destroy", cid)
    await checked(cache, "kept")
    await engine.emit("container", "die", "kept")
    assert set(cache._container_gen) == {"kept"} and not cache._facts
    # a check that began before a destroy is never kept: neither of a container that had no
    # event yet (its counter was absent) nor of one that had (its counter was dropped)
    fresh, seen = cache.token("c1"), cache.token("kept")
    await engine.emit("container", "destroy", "c1")
    await engine.emit("container", "destroy", "kept")
    cache.put(fresh, facts("c1"))
    cache.put(seen, facts("kept"))
    assert cache.get("c1", "root-1") is None and cache.get("kept", "root-1") is None
    await checked(cache, "c2")  # a check that began after it is kept
    assert cache.get("c2", "root-1") is not None


async def test_another_containers_destroy_during_a_check_keeps_its_facts(live) -> None:
    """A host's other chats come and go (and its start-up probe's container goes while the first
    chat's sandbox is created): their destroys do not spoil a check of this container."""
    cache, engine = live
    await checked(cache, "seen")
    await engine.emit("container", "die", "seen")  # it has a counter; "c1" has none yet
    fresh, seen = cache.token("c1"), cache.token("seen")
    await engine.emit("container", "die", "probe")
    await engine.emit("container", "destroy", "probe")
    cache.put(fresh, facts("c1"))
    cache.put(seen, facts("seen"))
    assert cache.get("c1", "root-1") == facts("c1") and cache.get("seen", "root-1") == facts("seen")


async def test_a_check_that_outlived_more_destroys_than_are_remembered_is_not_kept(live) -> None:
    from sandbox_manager.integrity import RECENT_DESTROYS

    cache, engine = live
    token = cache.token("c1")
    await destroys(engine, [f"other-{n}" for n in range(RECENT_DESTROYS)])
    cache.put(token, facts("c1"))
    assert cache.get("c1", "root-1") == facts("c1")  # all of them remembered: none was c1
    token = cache.token("c2")
    await destroys(engine, [f"more-{n}" for n in range(RECENT_DESTROYS + 1)])
    cache.put(token, facts("c2"))
    assert cache.get("c2", "root-1") is None  # which went is no longer known: kept nothing
    assert len(cache._recent) == RECENT_DESTROYS


async def destroys(engine: FakeEvents, ids: list[str]) -> None:
    for cid in ids:
        await engine.send.send({"Type": "container", "Action": "destroy", "Actor": {"ID": cid}})
    await anyio.wait_all_tasks_blocked()


async def test_a_stream_gap_drops_everything_and_reconnects(live) -> None:
    cache, engine = live
    await checked(cache)
    stale = cache.token("c1")
    await engine.end()  # the engine restarted (or the stream failed)
    assert not cache.live and cache.get("c1", "root-1") is None and cache.token("c1") is None
    cache.put(stale, facts())
    assert cache.get("c1", "root-1") is None
    with anyio.fail_after(5):
        await engine.connected.wait()
    await anyio.wait_all_tasks_blocked()
    assert cache.live and engine.connections == 2
    cache.put(stale, facts())  # a token from the old connection is worthless
    assert cache.get("c1", "root-1") is None
    await checked(cache)
    assert cache.get("c1", "root-1") == facts()


def engine_checked(cache: IntegrityFacts) -> None:
    token = cache.engine_token()
    cache.put_engine_fact(token, "image:ref", ImageInfo(id="sha256:img", labels={}, tags=()))
    cache.put_engine_fact(token, "data_root", "root-1")


async def test_the_engines_own_facts_are_kept_while_live_and_dropped_by_any_image_event(live) -> None:
    """The image check and the data root (a new sandbox's two engine calls): a tag moved onto
    another image says ``tag``, so every image action drops them, not only delete and untag."""
    cache, engine = live
    engine_checked(cache)
    assert (cache.engine_fact("image:ref").id, cache.engine_fact("data_root")) == ("sha256:img", "root-1")
    await engine.emit("container", "die", "c9")  # another container's life changes neither
    assert cache.engine_fact("data_root") == "root-1"
    for action in ("tag", "import", "load", "pull", "delete", "untag"):
        engine_checked(cache)
        await engine.emit("image", action, "sha256:other")
        assert (cache.engine_fact("image:ref"), cache.engine_fact("data_root")) == (None, None), action


async def test_the_engines_own_facts_go_with_the_data_root_marker_and_the_stream(live) -> None:
    cache, engine = live
    engine_checked(cache)
    await engine.emit("volume", "destroy", DATA_ROOT_VOLUME)
    assert cache.engine_fact("data_root") is None
    engine_checked(cache)
    await engine.end()  # an engine restart (a swapped data root comes with one)
    assert cache.engine_fact("data_root") is None and cache.engine_token() is None
    engine_checked(cache)  # nothing is kept until the stream is back
    assert cache.engine_fact("data_root") is None


async def test_an_engine_check_that_raced_an_image_event_is_not_kept(live) -> None:
    cache, engine = live
    token = cache.engine_token()  # the image inspect under way ...
    await engine.emit("image", "tag", "sha256:new")  # ... while the tag moves
    cache.put_engine_fact(token, "image:ref", ImageInfo(id="sha256:img", labels={}, tags=()))
    assert cache.engine_fact("image:ref") is None


async def test_no_engine_fact_is_kept_without_a_stream() -> None:
    cache = IntegrityFacts(object())  # type: ignore[arg-type]
    engine_checked(cache)
    assert (cache.engine_token(), cache.engine_fact("data_root")) == (None, None)


# -- when a container stopped (a resident's turn whose CLI link ended at once: runner/stale_facts.py)


async def test_a_stop_is_placed_between_two_times_by_its_die_event(live) -> None:
    cache, engine = live
    await engine.emit("container", "die", "c1", at_ns=1_000)
    await engine.emit("container", "destroy", "c1", at_ns=1_500)  # its processes stopped at the die
    assert await cache.stopped_between("c1", 500, 1_200, wait_s=0) is True
    assert await cache.stopped_between("c1", 500, 1_000, wait_s=0) is False  # not before: at
    assert await cache.stopped_between("c1", 1_000, 9_000, wait_s=0) is False  # no stop after 1000 (the destroy is no later stop)
    assert await cache.stopped_between("c2", 0, 9_000, wait_s=0) is False


async def test_the_first_stop_after_the_start_time_decides(live) -> None:
    """Stopped before the resident was made, started again, stopped after the message: the
    resident's CLI was alive when the message was written."""
    cache, engine = live
    await engine.emit("container", "die", "c1", at_ns=100)
    await engine.emit("container", "start", "c1", at_ns=150)
    await engine.emit("container", "die", "c1", at_ns=900)
    assert await cache.stopped_between("c1", 200, 800, wait_s=0) is False
    assert await cache.stopped_between("c1", 200, 901, wait_s=0) is True


async def test_a_destroy_without_a_die_seen_is_the_stop(live) -> None:
    cache, engine = live
    await engine.emit("container", "destroy", "c1", at_ns=700)
    assert await cache.stopped_between("c1", 0, 701, wait_s=0) is True


async def test_a_stop_not_read_yet_is_waited_for_and_an_event_without_a_time_places_nothing(live) -> None:
    cache, engine = live
    answers: list[bool] = []

    async def ask() -> None:
        answers.append(await cache.stopped_between("c1", 0, 5_000, wait_s=10))

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(ask)
            await anyio.wait_all_tasks_blocked()
            await engine.emit("container", "die", "c1")  # no timeNano: cannot be placed in time
            await engine.emit("container", "die", "c2", at_ns=10)  # another container's
            assert answers == []
            await engine.emit("container", "die", "c1", at_ns=4_000)
    assert answers == [True]
    assert await cache.stopped_between("c3", 0, 5_000, wait_s=0.05) is False  # never came: no
