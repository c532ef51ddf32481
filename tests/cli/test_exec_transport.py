"""Real CLIs over the production transport: a sandbox exec stream as the runner hands it to a driver.

Driver tests run over the local-process transport; this module runs the launch path of the runner
(``start_in_sandbox`` -> ``runner.transport.exec_transport``) so an exec-stream error reaches the
drivers' error mapping exactly as in production. The stream's line bound is lowered so a normal
protocol line overruns it: that is the one stream failure a live CLI produces on demand.
Before the exec stream conformed to the transport contract, its ``ExecStreamClosed`` escaped
``CodexSession.run_turn`` and the Claude handshake instead of becoming ``NotSettled`` /
``HandshakeFailed`` (issue 11).
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import anyio
import pytest

from deploy.loopback import LoopbackFixture, reply
from drivers.base import NativeSession
from drivers.models import HandshakeFailed, HandshakeReason, NotSettled, NotSettledReason
from drivers.registry import get_driver
from images.identity import carries_bridge
from images.pins import load_pins
from runner.processes import member_paths, start_in_sandbox
from runner.transport import exec_transport
from sandbox_manager.engine import DockerEngine
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.store import Store
from tests.support.sealed import sealed_proxy

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


@pytest.fixture
async def manager(tmp_path, sandbox_image, docker_client) -> AsyncIterator[SandboxManager]:
    engine = DockerEngine()
    store = Store(tmp_path / "store.db")
    host = f"exec-transport-{uuid.uuid4().hex[:8]}"
    sockets = tempfile.mkdtemp(prefix="ca-xt-")  # short: a unix socket path has 107 bytes
    mgr = SandboxManager(engine, store, SandboxConfig(image=sandbox_image, socket_root=sockets, host_id=host,
                                                      require_helper=carries_bridge(load_pins())))
    async with AsyncExitStack() as stack:
        mgr._test_stack = stack  # type: ignore[attr-defined] - the sandboxes' model proxies
        yield mgr
    for row in docker_client.api.containers(all=True, filters={"label": f"org.cloud-agent.host-id={host}"}):
        docker_client.api.remove_container(row["Id"], force=True)
    for vol in (docker_client.api.volumes(filters={"label": f"org.cloud-agent.host-id={host}"}) or {}).get(
            "Volumes") or []:
        docker_client.api.remove_volume(vol["Name"])  # the sandboxes' state volumes
    shutil.rmtree(sockets, ignore_errors=True)
    store.close()
    engine.close()


async def start(manager: SandboxManager, fx: LoopbackFixture, runtime: str, max_line: int) -> tuple[NativeSession, Any]:
    user, chat = f"user-{uuid.uuid4().hex[:8]}", f"chat-{uuid.uuid4().hex[:8]}"
    # sealed: the sandbox reaches the fixture only through a model proxy on its own socket
    gate = await manager._test_stack.enter_async_context(  # type: ignore[attr-defined]
        sealed_proxy(fx.base_url, manager.socket_dir(user, chat), key="exec-transport-test-key"))
    sandbox = await manager.resolve(user, chat)
    driver = get_driver(runtime)
    dirs = manager.member_dirs("m1")
    gateway = gate.gateway(model=f"fixture-{runtime}")
    launch = driver.plan(member_paths(dirs), gateway, None)
    proc = await start_in_sandbox(manager, sandbox, dirs, launch)
    proc.stream.max_line = max_line
    return driver.session(exec_transport(proc.stream), launch), proc


async def stop(manager: SandboxManager, proc: Any) -> None:
    with anyio.CancelScope(shield=True):
        await manager.kill_group(proc.container_id, proc.pidfile)
        await proc.stream.aclose()


async def test_codex_turn_over_a_broken_exec_stream_is_transport_closed(manager, fx) -> None:
    session, proc = await start(manager, fx, "codex", max_line=16 * 1024)
    try:
        with anyio.fail_after(120):
            await session.handshake()
            fx.add_rule(reply("long " * 8000, match="make it long"))  # one 40 kB agent message line
            outcome = await session.run_turn("make it long", timeout_s=90)
        assert isinstance(outcome, NotSettled), outcome
        assert outcome.reason == NotSettledReason.TRANSPORT_CLOSED and "longer than" in outcome.detail, outcome
        assert session.locator is None  # nothing verified, nothing to save
    finally:
        await stop(manager, proc)


async def test_claude_handshake_over_a_broken_exec_stream_is_process_failed(manager, fx) -> None:
    # 2.1.220's initialize answer (commands, agents, models) is several kB on one line
    session, proc = await start(manager, fx, "claude", max_line=512)
    try:
        with anyio.fail_after(120), pytest.raises(HandshakeFailed) as failed:
            await session.handshake()
        assert failed.value.reason == HandshakeReason.PROCESS_FAILED and "longer than" in failed.value.detail
        assert fx.requests(kind="conversation") == []
    finally:
        await stop(manager, proc)
