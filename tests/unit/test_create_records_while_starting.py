"""A new sandbox whose marker was written from the host is recorded while the engine starts
it (start_while_recording, issue 16): both always end, and each failure is
raised as itself, the start's first."""

from __future__ import annotations

from types import SimpleNamespace

import anyio
import pytest

from sandbox_manager.engine import EngineError
from sandbox_manager.creation import start_while_recording
from state.contract import StoreUnavailable

pytestmark = pytest.mark.anyio

REC = SimpleNamespace(container_id="c1")


def manager(start, put):  # only what the method uses
    return SimpleNamespace(engine=SimpleNamespace(start=start), store=SimpleNamespace(put_sandbox=put))


async def test_the_record_is_committed_while_the_engine_starts_the_container() -> None:
    order: list[str] = []
    recorded = anyio.Event()

    async def start(container_id: str) -> None:
        order.append(f"start {container_id}")
        await recorded.wait()  # the start is still going when the record is committed
        order.append("started")

    async def put(rec) -> None:
        order.append("record")
        await anyio.sleep(0)
        order.append("recorded")
        recorded.set()

    await start_while_recording(manager(start, put), "c1", REC)  # type: ignore[arg-type]
    assert order == ["start c1", "record", "recorded", "started"]


async def test_a_failed_start_is_raised_as_itself_after_the_record_is_committed() -> None:
    written: list[str] = []

    async def start(container_id: str) -> None:
        raise EngineError("500 Server Error: cannot start container c1")

    async def put(rec) -> None:
        await anyio.sleep(0.01)  # the start fails first
        written.append(rec.container_id)

    with pytest.raises(EngineError, match="cannot start container c1"):
        await start_while_recording(manager(start, put), "c1", REC)  # type: ignore[arg-type]
    assert written == ["c1"]


async def test_a_failed_record_is_raised_as_itself_after_the_start_ended() -> None:
    started: list[str] = []

    async def start(container_id: str) -> None:
        await anyio.sleep(0.01)
        started.append(container_id)

    async def put(rec) -> None:
        raise StoreUnavailable("database is locked")

    with pytest.raises(StoreUnavailable, match="database is locked"):
        await start_while_recording(manager(start, put), "c1", REC)  # type: ignore[arg-type]
    assert started == ["c1"]


async def test_both_failed_raises_the_starts() -> None:
    async def start(container_id: str) -> None:
        await anyio.sleep(0.01)
        raise EngineError("cannot start container c1")

    async def put(rec) -> None:
        raise StoreUnavailable("database is locked")

    with pytest.raises(EngineError, match="cannot start container c1"):
        await start_while_recording(manager(start, put), "c1", REC)  # type: ignore[arg-type]
