"""Sandbox hardening, checked on the containers the real daemon / sandbox manager create."""

from __future__ import annotations

import json
import uuid

import pytest

from deploy.loopback import LoopbackFixture
from sandbox_manager.engine import DockerEngine
from sandbox_manager.sandboxes import SandboxConfig, SandboxManager
from state.store import Store
from tests.cli.attestation_helpers import wait_ready
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def assert_hardened(attrs: dict, *, network: str, memory: int, pids: int, nano_cpus: int) -> None:
    host = attrs["HostConfig"]
    assert host["Privileged"] is False
    assert host["CapDrop"] == ["ALL"] and not host["CapAdd"]
    assert host["SecurityOpt"] == ["no-new-privileges"]
    assert not host["Binds"] and attrs["Mounts"] == [] and not attrs["Config"].get("Volumes")
    assert not host["Devices"] and not host.get("DeviceRequests")
    assert host["PidMode"] == "" and host["UsernsMode"] == "" and host["IpcMode"] in ("private", "shareable")
    assert (host["Memory"], host["PidsLimit"], host["NanoCpus"]) == (memory, pids, nano_cpus)
    assert host["NetworkMode"] == network
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
        assert_hardened(container.attrs, network="host", memory=2 * 1024**3, pids=512,
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


@pytest.mark.parametrize("network", ["none", "named"])
async def test_the_configured_network_is_the_sandbox_network(network, tmp_path, sandbox_image, docker_client) -> None:
    name = network
    created = None
    if network == "named":
        name = f"ca-test-net-{uuid.uuid4().hex[:8]}"
        created = docker_client.networks.create(name, driver="bridge", internal=True)
    engine = DockerEngine()
    manager = SandboxManager(engine, Store(tmp_path / "store.db"),
                             SandboxConfig(image=sandbox_image, network=name,
                                           host_id=f"net-{uuid.uuid4().hex[:8]}"))
    sandbox = None
    try:
        sandbox = await manager.resolve("u-net", "c-net")
        attrs = docker_client.containers.get(sandbox.container_id).attrs
        assert_hardened(attrs, network=name, memory=4 * 1024**3, pids=1024, nano_cpus=2_000_000_000)
        assert list(attrs["NetworkSettings"]["Networks"]) == [name]
    finally:
        if sandbox is not None:
            docker_client.api.remove_container(sandbox.container_id, force=True)
        if created is not None:
            created.remove()
        engine.close()
