"""Resident memory readings from the host against a real sandbox: cgroup, NSpid, pgid, PSS."""

from __future__ import annotations

import uuid

import anyio
import pytest

from images.identity import carries_bridge
from images.pins import load_pins
from sandbox_manager.engine import DockerEngine
from sandbox_manager import launch_files
from sandbox_manager.proc_memory import ProcMemory
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.store import Store
from tests.support.sandbox import processes

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

MiB = 1024 * 1024
# 96 MiB touched by a node process, plus a child (that stays in the group) holding 48 MiB more
BIG = ("const b = Buffer.alloc(96 * 1024 * 1024, 1); "
       "require('child_process').spawn('node', ['-e', "
       "'const c = Buffer.alloc(48 * 1024 * 1024, 2); setInterval(() => c[0]++, 1000)'], {stdio: 'ignore'}); "
       "console.log('ready'); setInterval(() => b[0]++, 1000)")


@pytest.fixture
async def sandbox(tmp_path, sandbox_image, docker_client):
    engine = DockerEngine()
    store = Store(tmp_path / "store.db")
    mgr = SandboxManager(engine, store, SandboxConfig(image=sandbox_image, socket_root=str(tmp_path / "sockets"),
                                                      host_id="test-host", require_helper=carries_bridge(load_pins())))
    sb = await mgr.resolve(f"user-{uuid.uuid4().hex[:8]}", f"chat-{uuid.uuid4().hex[:8]}")
    yield mgr, sb
    docker_client.api.remove_container(sb.container_id, force=True)
    store.close()
    engine.close()


async def launch(mgr: SandboxManager, sb, name: str, script: str):
    dirs = mgr.member_dirs(name)
    pidfile = f"{dirs.run_dir}/cli.pid"
    argv = ["ca-launch", "--pidfile", pidfile, "--cwd", dirs.workspace, "--files-on-stdin", "--", "node", "-e", script]
    proc = await mgr.launch(sb, argv=argv, env={}, workdir="/home/agent", pidfile=pidfile,
                            files=launch_files.encode([], [], [dirs.run_dir]))
    with anyio.fail_after(30):
        assert await proc.stream.receive() == b"ready"
    return proc


async def test_group_memory_is_read_from_the_host(sandbox) -> None:
    mgr, sb = sandbox
    big = await launch(mgr, sb, "big", BIG)
    small = await launch(mgr, sb, "small", "console.log('ready'); setInterval(() => {}, 1000)")
    reader = ProcMemory()
    init_pid = sb.container.attrs["State"]["Pid"]
    assert reader.cgroup_procs_file(init_pid) is not None
    big_pg = reader.read_pidfile(init_pid, big.pidfile)
    small_pg = reader.read_pidfile(init_pid, small.pidfile)
    assert big_pg and small_pg and big_pg != small_pg
    procs = await processes(mgr.engine, sb.container_id)  # what the sandbox itself says (one exec)
    assert {p["pgid"] for p in procs if p["comm"] == "node"} == {str(big_pg), str(small_pg)}
    with anyio.fail_after(30):
        while True:  # the child needs a moment to touch its 48 MiB
            found = await anyio.to_thread.run_sync(reader.measure, init_pid, {big_pg, small_pg, 99999})
            if found[big_pg].pids == 2 and found[big_pg].bytes > 150 * MiB:
                break
            await anyio.sleep(0.2)
    assert set(found) == {big_pg, small_pg}  # an unknown group is left out
    assert (found[big_pg].pids, found[small_pg].pids) == (2, 1)
    assert 150 * MiB < found[big_pg].pss_bytes <= found[big_pg].rss_bytes < 400 * MiB
    assert 10 * MiB < found[small_pg].bytes < 100 * MiB
    assert found[big_pg].bytes - found[small_pg].bytes > 140 * MiB  # the 144 MiB the big one touched
    await mgr.kill_group(sb.container_id, big.pidfile)
    with anyio.fail_after(10):
        while big_pg in (await anyio.to_thread.run_sync(reader.measure, init_pid, {big_pg, small_pg})):
            await anyio.sleep(0.1)
    assert small_pg in await anyio.to_thread.run_sync(reader.measure, init_pid, {big_pg, small_pg})
    await mgr.kill_group(sb.container_id, small.pidfile)
    for proc in (big, small):
        await proc.stream.aclose()


def test_a_pid_that_is_not_a_container_init_reads_nothing() -> None:
    assert ProcMemory().measure(999_999_999, {1}) == {}
    assert ProcMemory().read_pidfile(999_999_999, "/x.pid") is None
