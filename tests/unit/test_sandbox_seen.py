"""A turn takes its claim's read of the chat's sandbox record under the chat's lock only while no
write of that record can have landed since (SandboxManager.resolve ``seen``, issue 16): one
store round trip per turn fewer, never a decision on a stale record."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sandbox_manager.identity import LostReason, SandboxLost
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.records import SandboxState
from state.store import Store
from tests.support.fake_engine import IMAGE, FakeEngine

pytestmark = pytest.mark.anyio

USER, CHAT = "u1", "c1"


@asynccontextmanager
async def running_sandbox(tmp_path: Path) -> AsyncIterator[tuple[SandboxManager, FakeEngine, list[str]]]:
    """A manager whose chat has a running sandbox: (manager, engine, the chats its store read)."""
    engine = FakeEngine()
    sockets = tempfile.mkdtemp(prefix="ca-seen-", dir="/tmp")  # a tmp_path is too long for a socket address
    store = Store(tmp_path / "store.db")
    manager = SandboxManager(engine, store,  # type: ignore[arg-type]
                             SandboxConfig(image=IMAGE, socket_root=sockets, host_id="host-t"))
    manager.release(await manager.resolve(USER, CHAT))
    reads: list[str] = []
    get = store.get_sandbox

    async def counted(user_id: str, chat_id: str):  # type: ignore[no-untyped-def]
        reads.append(chat_id)
        return await get(user_id, chat_id)

    store.get_sandbox = counted  # type: ignore[method-assign]
    yield manager, engine, reads


async def claimed(manager: SandboxManager, job: str, chat: str = CHAT):  # type: ignore[no-untyped-def]
    claim = await manager.store.claim_job(job, USER, chat, "m1", "d", "o", read_sandbox=True)
    assert claim.kind == "claimed"
    return claim.sandbox


async def test_a_current_read_of_the_claim_is_taken_without_a_read_of_its_own(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path) as (manager, _, reads):
        seen = await claimed(manager, "j1")
        sb = await manager.resolve(USER, CHAT, seen=seen)
        manager.release(sb)
        assert reads == [] and sb.record.container_id == seen.record.container_id
        manager.release(await manager.resolve(USER, CHAT))  # without one: read
        assert reads == [CHAT]


async def test_a_record_written_after_the_claim_is_read_again(tmp_path: Path) -> None:
    """The claim saw the sandbox running; it was recorded LOST before the turn took the chat's
    lock: the turn reads the record and is refused (the claim's read alone would have run it)."""
    async with running_sandbox(tmp_path) as (manager, _, reads):
        seen = await claimed(manager, "j1")
        assert seen.record.state == SandboxState.RUNNING
        await manager.store.set_sandbox_state(USER, CHAT, SandboxState.LOST, "container_missing")
        with pytest.raises(SandboxLost) as lost:
            await manager.resolve(USER, CHAT, seen=seen)
        assert (lost.value.reason, reads) == (LostReason.PREVIOUSLY_LOST, [CHAT])


async def test_a_stop_after_the_claim_starts_the_sandbox_again(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path) as (manager, engine, reads):
        seen = await claimed(manager, "j1")
        assert await manager.stop(USER, CHAT)
        engine.calls.clear()
        reads.clear()  # the stop's own
        sb = await manager.resolve(USER, CHAT, seen=seen)
        manager.release(sb)
        assert (sb.started, reads) == (True, [CHAT])
        assert "start" in engine.calls


async def test_another_chats_read_is_never_taken(tmp_path: Path) -> None:
    async with running_sandbox(tmp_path) as (manager, _, reads):
        seen = await claimed(manager, "j1", chat="elsewhere")
        sb = await manager.resolve(USER, CHAT, seen=seen)
        manager.release(sb)
        assert reads == [CHAT] and sb.record.chat_id == CHAT
