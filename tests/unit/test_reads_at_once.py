"""A recorded sandbox's four engine reads are made at once and judged in their old order
(sandbox_manager.reads_at_once, issue 16): the data root, the image, the chat's volume and
its container. The first check that fails still names the reason."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

from sandbox_manager.engine import NotFound
from sandbox_manager.identity import LostReason, SandboxLost
from sandbox_manager.reads_at_once import read_at_once
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.store import Store
from tests.support.fake_engine import IMAGE, FakeEngine

pytestmark = pytest.mark.anyio

USER, CHAT = "u1", "c1"


async def test_each_answer_comes_in_the_order_asked_with_its_error_kept() -> None:
    async def slow() -> str:
        await anyio.sleep(0.02)
        return "slow"

    async def fails() -> str:
        raise NotFound("gone")

    async def fast() -> str:
        return "fast"

    first, second, nothing, third = await read_at_once(slow, fails, None, fast)
    assert (first.get(), nothing.get(), third.get()) == ("slow", None, "fast")
    with pytest.raises(NotFound, match="gone"):
        second.get()


class Barrier:
    """Lets each waiter through once ``n`` have arrived: reads made one after the other never
    get there (the first waits for the others for ever)."""

    def __init__(self, n: int) -> None:
        self.n, self.arrived, self.names = n, 0, []
        self.all_in = anyio.Event()

    async def wait(self, name: str) -> None:
        self.arrived += 1
        self.names.append(name)
        if self.arrived >= self.n:
            self.all_in.set()
        await self.all_in.wait()


@asynccontextmanager
async def recorded(tmp_path: Path) -> AsyncIterator[tuple[SandboxManager, FakeEngine]]:
    engine = FakeEngine()
    sockets = tempfile.mkdtemp(prefix="ca-reads-", dir="/tmp")  # a tmp_path is too long for a socket address
    manager = SandboxManager(engine, Store(tmp_path / "store.db"),  # type: ignore[arg-type]
                             SandboxConfig(image=IMAGE, socket_root=sockets, host_id="host-t"))
    manager.release(await manager.resolve(USER, CHAT))
    yield manager, engine


def gated(engine: FakeEngine, barrier: Barrier) -> None:
    """The four reads of a recorded sandbox's check wait at ``barrier`` before they answer."""
    for name in ("data_root_identity", "image", "inspect_volume", "inspect"):
        real = getattr(engine, name)

        async def read(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            await barrier.wait(_name)
            return await _real(*args, **kwargs)

        setattr(engine, name, read)


async def test_the_four_reads_of_a_check_are_in_flight_together(tmp_path: Path) -> None:
    async with recorded(tmp_path) as (manager, engine):
        barrier = Barrier(4)
        gated(engine, barrier)
        with anyio.fail_after(5):  # one after the other, the first read would wait here for ever
            sandbox = await manager.resolve(USER, CHAT)  # not resident: checked against the engine
        manager.release(sandbox)
        assert sorted(barrier.names) == ["data_root_identity", "image", "inspect", "inspect_volume"]
        assert sandbox.container.status == "running" and not sandbox.created


async def lose_container_and_volume(manager: SandboxManager, engine: FakeEngine) -> None:
    rec = await manager.store.get_sandbox(USER, CHAT)
    assert rec is not None and rec.volume_name is not None
    engine.containers.clear()
    engine.volumes.pop(rec.volume_name)


async def test_a_changed_data_root_is_named_before_a_missing_volume_or_container(tmp_path: Path) -> None:
    async with recorded(tmp_path) as (manager, engine):
        await lose_container_and_volume(manager, engine)
        engine.data_root = "root-2"
        with pytest.raises(SandboxLost) as lost:
            await manager.resolve(USER, CHAT)
        assert lost.value.reason == LostReason.DATA_ROOT_CHANGED


async def test_a_missing_volume_is_named_before_a_missing_container(tmp_path: Path) -> None:
    """Read together, the container's NotFound must not turn a lost volume into a new container."""
    async with recorded(tmp_path) as (manager, engine):
        await lose_container_and_volume(manager, engine)
        engine.calls.clear()
        with pytest.raises(SandboxLost) as lost:
            await manager.resolve(USER, CHAT)
        assert lost.value.reason == LostReason.VOLUME_MISSING
        assert "create" not in engine.calls and "create_volume" not in engine.calls


async def test_what_must_come_before_a_start_runs_beside_the_reads_and_before_the_start(tmp_path: Path) -> None:
    """The caller's model socket (``before_start``) is opened while the check reads the engine,
    and has been opened before the stopped container is started again."""
    async with recorded(tmp_path) as (manager, engine):
        assert await manager.stop(USER, CHAT)
        barrier = Barrier(5)
        gated(engine, barrier)
        engine.calls.clear()

        async def open_socket() -> None:
            await barrier.wait("socket")
            engine.calls.append("socket opened")

        with anyio.fail_after(5):  # after the reads, or before them, it would wait here for ever
            sandbox = await manager.resolve(USER, CHAT, before_start=open_socket)
        manager.release(sandbox)
        # the first five to arrive (the start's own reads come after, through an open barrier)
        assert sandbox.started and sorted(barrier.names[:5]) == ["data_root_identity", "image", "inspect",
                                                                 "inspect_volume", "socket"]
        assert engine.calls.index("socket opened") < engine.calls.index("start")


async def test_a_new_sandbox_is_made_only_once_what_comes_first_is_done(tmp_path: Path) -> None:
    async with recorded(tmp_path) as (manager, engine):
        engine.calls.clear()

        async def open_socket() -> None:
            engine.calls.append("socket opened")

        sandbox = await manager.resolve(USER, "c2", before_start=open_socket)
        manager.release(sandbox)
        assert sandbox.created and engine.calls[0] == "socket opened"
        assert engine.calls.index("create_volume") > 0 and engine.calls.index("create") > 0
