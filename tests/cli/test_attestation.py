"""Host attestation against a real daemon, a real engine and the pinned image: the document,
`cloud-agent attest`, the probe schedule, no leaked probe containers, and an image with an
older helper that never reports ready and from which no sandbox is ever created."""

from __future__ import annotations

import json
import sys
import uuid

import anyio
import docker.errors
import pytest

from deploy.loopback import LoopbackFixture
from images.pins import load_pins
from runner.probe import PROBE_LABEL
from sandbox_manager.chat_containers import ImageRefused
from sandbox_manager.identity import container_name
from tests.cli.attestation_helpers import REPO, git_dirty, git_head, probe_containers, relabelled_image, wait_ready
from tests.daemon_harness import TOKEN, daemon_settings, running_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


async def test_the_attestation_document_of_a_running_daemon(fx, tmp_path, sandbox_image, docker_client) -> None:
    heads, dirty = {git_head()}, {git_dirty()}
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, heartbeat_interval_s=0.5)
    async with running_daemon(settings) as d:
        heads.add(git_head())
        dirty.add(git_dirty())
        assert await wait_ready(d.client) == {"ready": True, "reasons": [], "detail": {}}
        doc = (await d.client.get("/v1/attestation")).json()
        # the exact source the daemon runs (others commit to this checkout concurrently)
        assert doc["source"]["sha"] in heads and doc["source"]["dirty"] in dirty
        assert doc["source"]["origin"] == "git" and doc["api_version"] == "1"
        assert doc["host_id"] == settings.host_id
        image = docker_client.images.get(sandbox_image)
        assert doc["image"] == {"ref": sandbox_image, "id": image.id, "digest": image.id, "tags": image.tags,
                                "labels": image.labels, "helper_version": "4", "problems": []}
        assert image.labels["http-agent-live-bridge"] == "4"
        pins = load_pins()
        assert doc["required_helper"] == {"name": "http-agent-live-bridge", "version": pins.helper.version}
        assert doc["pins"] == {r: p.spec for r, p in pins.cli.items()} | {"node": pins.node.version}
        version = docker_client.version()
        volume = docker_client.volumes.get("cloud-agent-dataroot-identity")
        assert doc["engine"] == {"reachable": True, "version": version["Version"],
                                 "api_version": version["ApiVersion"],
                                 "data_root_id": volume.attrs["Labels"]["org.cloud-agent.dataroot-id"]}
        probe = doc["reverse_probe"]
        assert (probe["ok"], probe["failed_step"], probe["error"], probe["removed"]) == (True, None, None, True)
        assert probe["image_id"] == image.id and probe["helper_binary_version"] == "4"
        assert list(probe["steps_ms"]) == ["ping", "sweep", "data_root", "image_inspect", "create", "start", "exec", "helper",
                                           "remove", "total"]
        assert probe["stale"] is False and probe["interval_s"] == 60.0
        # the heartbeat is live: its count advances (waited on, not slept for), and it is fresh
        first = doc["heartbeat"]["beats"]
        with anyio.fail_after(30):
            while (hb := (await d.client.get("/v1/attestation")).json()["heartbeat"])["beats"] < first + 2:
                await anyio.sleep(0.05)
        assert hb["interval_s"] == 0.5 and hb["stale"] is False and hb["age_s"] <= hb["stale_after_s"]
        assert doc["dependencies"] == {"control_plane": None}
        assert doc["readiness"] == {"ready": True, "reasons": [], "detail": {}}
        assert probe_containers(docker_client, settings.host_id) == []

        # `cloud-agent attest`: the same document through the CLI client
        token = tmp_path / "home" / "token"
        out = await anyio.run_process([sys.executable, "-m", "runner.cli", "--url", d.url, "--token-file",
                                       str(token), "attest"], cwd=REPO, check=False)
        assert out.returncode == 0, out.stderr
        printed = json.loads(out.stdout)
        assert printed["source"] == doc["source"] and printed["image"] == doc["image"]
        bad = tmp_path / "wrong-token"
        bad.write_text("wrong-token-0123456789abcdef")
        out = await anyio.run_process([sys.executable, "-m", "runner.cli", "--url", d.url, "--token-file",
                                       str(bad), "attest"], cwd=REPO, check=False)
        assert (out.returncode, out.stdout) == (1, b"")
        assert out.stderr.decode() == "error: HTTP 401: {'error': 'unauthorized'}\n"
        assert TOKEN not in out.stderr.decode()


async def test_probe_schedule_is_configurable_and_probe_containers_never_linger(
        fx, tmp_path, sandbox_image, docker_client) -> None:
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, probe_interval_s=0.3,
                               probe_timeout_s=1.5, host_id=f"att-{uuid.uuid4().hex[:10]}")
    # a probe container a killed daemon of this host left behind (older than 2 x the timeout)
    leftover = docker_client.containers.create(sandbox_image, name=f"ca-probe-leftover-{tmp_path.name[-8:]}",
                                               labels={PROBE_LABEL: settings.host_id}, network_mode="none")
    await anyio.sleep(3.2)
    async with running_daemon(settings) as d:
        await wait_ready(d.client)
        seen_at, seen_names = set(), set()
        with anyio.fail_after(30):
            while len(seen_at) < 4:
                doc = (await d.client.get("/v1/attestation")).json()
                seen_at.add(doc["reverse_probe"]["at"])
                assert doc["reverse_probe"]["ok"] is True and doc["reverse_probe"]["interval_s"] == 0.3
                seen_names |= {c.name for c in probe_containers(docker_client, settings.host_id)}
                await anyio.sleep(0.05)
        with pytest.raises(docker.errors.NotFound):
            leftover.reload()  # swept
        assert leftover.name not in {c.name for c in probe_containers(docker_client, settings.host_id)}
    # every probe removed its container; no sandbox was ever created by probing
    assert probe_containers(docker_client, settings.host_id) == []
    assert docker_client.containers.list(all=True, filters={"label": f"org.cloud-agent.host-id={settings.host_id}"}) \
        == []
    assert all(n.startswith("ca-probe-") for n in seen_names)


async def test_an_image_with_an_older_helper_never_reports_ready_and_creates_no_sandbox(
        fx, tmp_path, sandbox_image, docker_client) -> None:
    with relabelled_image(sandbox_image, **{"http-agent-live-bridge": "3"}) as old:
        settings = daemon_settings(tmp_path / "home", fx.base_url, old, probe_interval_s=0.5,
                                   host_id=f"att-{uuid.uuid4().hex[:10]}")
        async with running_daemon(settings) as d:
            body = await wait_ready(d.client, want=503)
            image_id = docker_client.images.get(old).id
            assert body["reasons"] == ["helper_pin_mismatch", "reverse_probe_failed"]
            assert body["detail"]["helper_pin_mismatch"] == "image has http-agent-live-bridge=3, the pin is 4"
            assert body["detail"]["reverse_probe_failed"] == (
                f"image_inspect: ImageRefused: image {old} ({image_id[:19]}) refused: "
                "label http-agent-live-bridge=3 (want 4)")
            await anyio.sleep(1.2)  # later probes fail the same way: never ready
            resp = await d.client.get("/readyz")
            assert resp.status_code == 503 and resp.json() == body
            doc = (await d.client.get("/v1/attestation")).json()
            assert doc["image"]["helper_version"] == "3" and doc["image"]["id"] == image_id
            assert doc["image"]["problems"] == ["label http-agent-live-bridge=3 (want 4)"]
            assert doc["readiness"]["ready"] is False

            # the sandbox manager refuses the image: no container, the model never sees the message
            with pytest.raises(ImageRefused):
                await d.daemon.supervisor.manager.checked_image(old)
            chat = Chat("codex")
            receipt, _, resp = await d.run(chat.job("this must never reach a model"))
            assert resp.status_code == 200
            assert (receipt["outcome"], receipt["reason"]) == ("refused", "image_unsupported")
            assert receipt["sandbox"] == {"container_id": None, "image_id": None, "helper_version": None,
                                          "volume": None, "recreated": False}
            assert fx.requests() == []
            with pytest.raises(docker.errors.NotFound):
                docker_client.containers.get(container_name(chat.user_id, chat.chat_id))
            assert probe_containers(docker_client, settings.host_id) == []
