"""A stopped sandbox is started and its volume's marker checked from the model gate's listening
line (SandboxManager._start_checked, issue 16): no archive read beside the engine's start, the
same verdicts as the archive read gave, and the archive read still where the line cannot say."""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from sandbox_manager.engine import ContainerSpec
from sandbox_manager.identity import LostReason, SandboxLost, digest
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.sealing import MODEL_GATE_COMMAND
from sandbox_manager.volumes import MARKER_PATH, marker_bytes
from state.store import Store
from tests.support.fake_engine import IMAGE, FakeEngine

pytestmark = pytest.mark.anyio

USER, CHAT = "u1", "c1"


@asynccontextmanager
async def stopped_sandbox(tmp_path: Path) -> AsyncIterator[tuple[SandboxManager, FakeEngine, str]]:
    """A manager whose chat has a sandbox, stopped: (manager, engine, volume)."""
    engine = FakeEngine()
    sockets = tempfile.mkdtemp(prefix="ca-start-", dir="/tmp")  # a tmp_path is too long for a socket address
    manager = SandboxManager(engine, Store(tmp_path / "store.db"),  # type: ignore[arg-type]
                             SandboxConfig(image=IMAGE, socket_root=sockets, host_id="host-t"))
    sb = await manager.resolve(USER, CHAT)
    manager.release(sb)
    assert await manager.stop(USER, CHAT)
    engine.calls.clear()
    yield manager, engine, sb.volume


def wrong_marker(engine: FakeEngine, volume: str) -> None:
    engine.volume_files[volume][MARKER_PATH] = marker_bytes(digest("sandbox", USER, CHAT), "f" * 32)


async def test_a_restart_checks_the_marker_from_the_gate_line_without_an_archive_read(tmp_path: Path) -> None:
    async with stopped_sandbox(tmp_path) as (manager, engine, _):
        sb = await manager.resolve(USER, CHAT)
        assert sb.started and sb.container.running
        assert engine.calls == ["image", "start", "wait_log_line"]


async def test_a_wrong_marker_in_the_gate_line_is_lost_and_the_container_stopped_again(tmp_path: Path) -> None:
    async with stopped_sandbox(tmp_path) as (manager, engine, volume):
        wrong_marker(engine, volume)
        with pytest.raises(SandboxLost) as lost:
            await manager.resolve(USER, CHAT)
        rec = await manager.store.get_sandbox(USER, CHAT)
        assert (lost.value.reason, str(lost.value.detail), rec.lost_reason) == (
            LostReason.VOLUME_MISMATCH, f"volume {volume}: the identity marker names volume id ffffffffffff, not "
                                        f"{rec.volume_id[:12]}", "volume_mismatch")
        assert engine.calls == ["image", "start", "wait_log_line", "stop"]
        assert not engine._get(rec.container_id).running


async def test_an_absent_marker_in_the_gate_line_is_lost(tmp_path: Path) -> None:
    async with stopped_sandbox(tmp_path) as (manager, engine, volume):
        del engine.volume_files[volume][MARKER_PATH]
        with pytest.raises(SandboxLost) as lost:
            await manager.resolve(USER, CHAT)
        assert (lost.value.reason, str(lost.value.detail)) == (
            LostReason.VOLUME_MISMATCH, f"volume {volume}: no identity marker at {MARKER_PATH}")


async def test_a_gate_started_without_the_marker_flag_falls_back_to_the_archive_read(tmp_path: Path) -> None:
    """A container made before ``--marker``: its gate's line cannot say, the archive read does."""
    async with stopped_sandbox(tmp_path) as (manager, engine, volume):
        rec = await manager.store.get_sandbox(USER, CHAT)
        engine.containers[rec.container_id].attrs["Config"]["Cmd"] = list(MODEL_GATE_COMMAND[:-2])
        await manager.resolve(USER, CHAT)
        assert engine.calls == ["image", "start", "wait_log_line", "read_file"]
        assert await manager.stop(USER, CHAT)
        wrong_marker(engine, volume)
        engine.calls.clear()
        with pytest.raises(SandboxLost, match="names volume id ffffffffffff"):
            await manager.resolve(USER, CHAT)
        assert engine.calls == ["image", "start", "wait_log_line", "read_file", "stop"]


async def test_a_marker_problem_is_raised_over_a_gate_that_did_not_come_up(tmp_path: Path) -> None:
    async with stopped_sandbox(tmp_path) as (manager, engine, volume):
        wrong_marker(engine, volume)

        async def silent(container_id: str, needle: str, *, since: float, timeout_s: float) -> str | None:
            engine.calls.append("wait_log_line")
            return None

        engine.wait_log_line = silent  # type: ignore[method-assign]
        with pytest.raises(SandboxLost, match="names volume id ffffffffffff"):
            await manager.resolve(USER, CHAT)
        assert engine.calls == ["image", "start", "wait_log_line", "read_file", "stop"]


def test_the_sandbox_command_points_its_gate_at_the_marker() -> None:
    spec = ContainerSpec(image="i", name="n", labels={}, command=MODEL_GATE_COMMAND)
    assert list(spec.command[-2:]) == ["--marker", MARKER_PATH]
