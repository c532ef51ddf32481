"""Sandbox hardening, checked on the containers the real daemon / sandbox manager create."""

from __future__ import annotations

import json
import uuid

import pytest

from deploy.loopback import LoopbackFixture
from sandbox_manager.engine import DockerEngine
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.store import Store
from tests.cli.attestation_helpers import wait_ready
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def assert_hardened(attrs: dict, *, sockets: str, memory: int, pids: int, nano_cpus: int) -> None:
    host = attrs["HostConfig"]
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    # two mounts: the sandbox's own model socket directory, read-only (SPEC 7), and the chat's
    # state volume at the agent's home (SPEC 15); no other host path
    volume = f"{attrs['Name'].lstrip('/')}-home"
    assert sorted(host["Binds"]) == sorted([f"{sockets}:/run/cloud-agent/model:ro", f"{volume}:/home/agent:rw"])
    assert attrs["Config"].get("Volumes") == {"/run/cloud-agent/model": {}, "/home/agent": {}}
    assert sorted((m["Type"], m.get("Name") or m["Source"], m["Destination"], m["RW"]) for m in attrs["Mounts"]) == [
        ("bind", sockets, "/run/cloud-agent/model", False), ("volume", volume, "/home/agent", True)]
    assert not host["Devices"] and not host.get("DeviceRequests")
    assert host["PidMode"] == "" and host["UsernsMode"] == "" and host["IpcMode"] in ("private", "shareable")
    assert (host["Memory"], host["PidsLimit"], host["NanoCpus"]) == (memory, pids, nano_cpus)
    assert host["NetworkMode"] == "none" and list(attrs["NetworkSettings"]["Networks"]) == ["none"]
    assert host["Init"] is True
    assert attrs["Config"]["User"] == "agent"
    assert "docker.sock" not in json.dumps(attrs)


def status_field(container, field: str) -> str:
    out = container.exec_run(["cat", "/proc/self/status"], user="agent").output.decode()
    return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith(field + ":"))


async def test_the_daemons_sandbox_is_hardened(fx, tmp_path, sandbox_image, docker_client) -> None:
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image,
                               host_id=f"harden-{uuid.uuid4().hex[:8]}", memory_bytes=2 * 1024**3, pids_limit=512)
    async with running_daemon(settings) as d:
        await wait_ready(d.client)
        receipt, events, _ = await d.run(Chat("codex").job("hello"))
        assert receipt["outcome"] == "succeeded", events
        container = docker_client.containers.get(receipt["sandbox"]["container_id"])
        sockets = str(d.daemon.supervisor.manager.socket_dir(receipt["user_id"], receipt["chat_id"]))
        assert_hardened(container.attrs, sockets=sockets, memory=2 * 1024**3, pids=512,
                        nano_cpus=settings.nano_cpus)
        # inside: uid agent, no capabilities at all (bounding set empty), no-new-privileges
        assert container.exec_run(["id", "-u"], user="agent").output.strip() == b"1000"
        for field in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
            assert status_field(container, field) == "0000000000000000", field
        assert status_field(container, "NoNewPrivs") == "1"
        assert container.exec_run(["sh", "-c", "test -e /var/run/docker.sock || test -e /run/docker.sock"],
                                  user="agent").exit_code == 1
        # every process in the sandbox, the resident CLI included, runs as agent
        ps = container.exec_run(["ps", "-eo", "uid=,comm="], user="agent").output.decode().split("\n")
        rows = [line.split(None, 1) for line in ps if line.strip()]
        assert any("codex" in comm for _, comm in rows), rows
        assert {uid for uid, _ in rows} == {"1000"}, rows


async def test_a_sandbox_of_the_manager_is_sealed(tmp_path, sandbox_image, docker_client) -> None:
    # there is no network setting any more: every sandbox is network none with its socket dir
    engine = DockerEngine()
    manager = SandboxManager(engine, Store(tmp_path / "store.db"),
                             SandboxConfig(image=sandbox_image, socket_root=str(tmp_path / "s"),
                                           host_id=f"net-{uuid.uuid4().hex[:8]}"))
    sandbox = None
    try:
        sandbox = await manager.resolve("u-net", "c-net")
        attrs = docker_client.containers.get(sandbox.container_id).attrs
        assert_hardened(attrs, sockets=str(manager.socket_dir("u-net", "c-net")), memory=4 * 1024**3, pids=1024,
                        nano_cpus=2_000_000_000)
    finally:
        if sandbox is not None:
            docker_client.api.remove_container(sandbox.container_id, force=True)
            docker_client.api.remove_volume(sandbox.volume)
        engine.close()
