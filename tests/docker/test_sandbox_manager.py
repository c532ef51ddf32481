"""The sandbox manager against the real engine and the pinned image."""

from __future__ import annotations

import json
import uuid

import anyio
import pytest

from images.identity import carries_bridge
from images.pins import load_pins
from sandbox_manager.engine import ContainerInfo, DockerEngine, FileEntry
from sandbox_manager.sandboxes import (
    LABEL_IDENTITY,
    LostReason,
    SandboxConfig,
    SandboxLost,
    SandboxManager,
    container_name,
)
from state.records import SandboxState
from state.store import Store
from tests.support.sandbox import processes
from tests.support.store import rows

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def manager(tmp_path, sandbox_image, docker_client):
    engine = DockerEngine()
    store = Store(tmp_path / "store.db")
    mgr = SandboxManager(engine, store, SandboxConfig(image=sandbox_image, socket_root=str(tmp_path / "sockets"), host_id="test-host",
                                                      require_helper=carries_bridge(load_pins())))
    created: list[str] = []
    mgr._test_created = created  # type: ignore[attr-defined]
    yield mgr
    for rec in rows(store, "sandboxes"):
        try:
            docker_client.api.remove_container(rec["container_id"], force=True)
        except Exception:
            pass
    store.close()
    engine.close()


def ids() -> tuple[str, str]:
    return f"user-{uuid.uuid4().hex[:8]}", f"chat-{uuid.uuid4().hex[:8]}"


async def test_create_hardened_and_retained(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    assert sb.created and sb.container.running
    attrs = docker_client.api.inspect_container(sb.container_id)
    host = attrs["HostConfig"]
    assert attrs["Name"] == "/" + container_name(user, chat)
    assert user not in attrs["Name"] and chat not in attrs["Name"]
    assert host["Init"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["Privileged"] is False
    assert host["NetworkMode"] == "none"
    assert host["Memory"] > 0 and host["PidsLimit"] > 0
    assert host["MemorySwap"] == host["Memory"]  # no swap beyond the memory limit
    assert attrs["Config"]["User"] == "agent"
    # the one mount: its own model socket directory, read-only (SPEC 7)
    assert [(m["Type"], m["Source"], m["Destination"], m["RW"]) for m in attrs["Mounts"]] == [
        ("bind", str(manager.socket_dir(user, chat)), "/run/cloud-agent/model", False)]
    assert attrs["Config"]["Cmd"] == ["ca-modelgate", "--socket", "/run/cloud-agent/model/model.sock",
                                      "--listen", "127.0.0.1:18080"]
    # retained: a file survives stop/start
    code, _ = await manager.engine.exec_run(sb.container_id, ["sh", "-c", "echo kept > /home/agent/workspace/m"])
    assert code == 0
    assert await manager.stop(user, chat)
    assert (await manager.store.get_sandbox(user, chat)).state == SandboxState.STOPPED
    again = await manager.resolve(user, chat)
    assert again.container_id == sb.container_id and again.started and not again.created
    code, out = await manager.engine.exec_run(sb.container_id, ["cat", "/home/agent/workspace/m"])
    assert (code, out) == (0, b"kept\n")


async def test_attached_exec_round_trip_and_group_kill(manager: SandboxManager) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    dirs = manager.member_dirs("m1")
    await manager.prepare_files(sb, [FileEntry(f"{dirs.home}/conf.json", b'{"a": 1}\n')], [], [dirs.run_dir])
    pidfile = f"{dirs.run_dir}/cli.pid"
    argv = ["ca-launch", "--pidfile", pidfile, "--cwd", dirs.workspace, "--",
            "sh", "-c", 'echo "plain=$PLAIN"; cat "$0"; sleep 300 & exec cat', f"{dirs.home}/conf.json"]
    proc = await manager.launch(sb, argv=argv, env={"PLAIN": "1"}, workdir=dirs.workspace, pidfile=pidfile)
    with anyio.fail_after(20):
        assert await proc.stream.receive() == b"plain=1"
        assert await proc.stream.receive() == b'{"a": 1}'
        payload = "多段\n".encode()
        await proc.stream.send(b'{"hello": "\xe4\xb8\x96\xe7\x95\x8c"}')
        assert await proc.stream.receive() == b'{"hello": "\xe4\xb8\x96\xe7\x95\x8c"}'
        assert payload
    procs = await processes(manager.engine, sb.container_id)
    pg = next(p["pgid"] for p in procs if p["comm"] == "cat")
    assert any(p["comm"] == "sleep" and p["pgid"] == pg for p in procs)
    await manager.kill_group(sb.container_id, pidfile)
    with anyio.fail_after(10):
        while await proc.stream.receive() is not None:
            pass
    procs = await processes(manager.engine, sb.container_id)
    assert not [p for p in procs if p["pgid"] == pg], procs
    assert not [p for p in procs if "Z" in p["stat"]], "killed processes must be reaped (init=True)"
    await proc.stream.aclose()


async def test_launch_precheck_failure_is_a_line(manager: SandboxManager) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    argv = ["ca-launch", "--pidfile", "/home/agent/x.pid", "--require-file", "/home/agent/nope.jsonl", "--", "true"]
    proc = await manager.launch(sb, argv=argv, env={}, workdir="/home/agent", pidfile="/home/agent/x.pid")
    with anyio.fail_after(10):
        line = await proc.stream.receive()
        assert json.loads(line) == {"type": "launch_error", "reason": "missing_file", "path": "/home/agent/nope.jsonl"}
        assert await proc.stream.receive() is None
    assert await manager.engine.exec_exit_code(proc.stream.exec_id) == 3


async def test_lost_when_container_removed(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    docker_client.api.remove_container(sb.container_id, force=True)
    with pytest.raises(SandboxLost) as err:
        await manager.resolve(user, chat)
    assert err.value.reason == LostReason.CONTAINER_MISSING
    with pytest.raises(SandboxLost) as err:  # a LOST sandbox stays LOST, no quiet re-creation
        await manager.resolve(user, chat)
    assert err.value.reason == LostReason.PREVIOUSLY_LOST


async def test_lost_when_labels_tampered(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    # Replace the container by one with the same name but other identity labels.
    docker_client.api.remove_container(sb.container_id, force=True)
    other = docker_client.containers.create(sb.image.id, name=sb.record.container_name, init=True,
                                            labels={LABEL_IDENTITY: "forged"}, network_mode="none")
    rec = await manager.store.get_sandbox(user, chat)
    await manager.store.put_sandbox(rec.model_copy(update={"container_id": other.id}))
    with pytest.raises(SandboxLost) as err:
        await manager.resolve(user, chat)
    assert err.value.reason == LostReason.LABELS_MISMATCH
    other.remove(force=True)


async def test_a_sandbox_from_before_sealing_is_refused_not_sealed_in_place(manager: SandboxManager,
                                                                           docker_client) -> None:
    # Sandboxes created before issue 12 ran `sleep infinity` without a model socket mount (with
    # host networking for a loopback gateway). Docker cannot add a mount or change the network
    # of an existing container, and a new one would lose the native state: refused, named.
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    labels = docker_client.api.inspect_container(sb.container_id)["Config"]["Labels"]
    docker_client.api.remove_container(sb.container_id, force=True)
    old = docker_client.containers.create(sb.image.id, ["sleep", "infinity"], name=sb.record.container_name,
                                          init=True, labels=labels, network_mode="none", user="agent")
    rec = await manager.store.get_sandbox(user, chat)
    await manager.store.put_sandbox(rec.model_copy(update={"container_id": old.id}))
    with pytest.raises(SandboxLost) as err:
        await manager.resolve(user, chat)
    assert err.value.reason == LostReason.NOT_SEALED
    assert err.value.detail == (f"no read-only model socket mount of {manager.socket_dir(user, chat)} "
                                "at /run/cloud-agent/model")
    assert (await manager.store.get_sandbox(user, chat)).lost_reason == "sandbox_not_sealed"
    old.remove(force=True)
    # the host-networked variant, judged from its inspect document (never run here)
    host_net = ContainerInfo(id="x", name="n", status="exited", image_id="i", labels={},
                             attrs={"HostConfig": {"NetworkMode": "host"}, "Mounts": []})
    with pytest.raises(SandboxLost) as err:
        manager._check_sealed(rec, host_net)
    assert (err.value.reason, err.value.detail) == (
        LostReason.NOT_SEALED, "created with network 'host'; sandboxes are now sealed (network none) and this one "
        "cannot be sealed in place")


async def test_lost_when_data_root_identity_changes(manager: SandboxManager) -> None:
    user, chat = ids()
    await manager.resolve(user, chat)
    rec = await manager.store.get_sandbox(user, chat)
    await manager.store.put_sandbox(rec.model_copy(update={"data_root_id": "another-data-root"}))
    with pytest.raises(SandboxLost) as err:
        await manager.resolve(user, chat)
    assert err.value.reason == LostReason.DATA_ROOT_CHANGED
