"""The measured disk bound and retention through the real daemon, engine and codex CLI."""

from __future__ import annotations

import anyio
import docker
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.loopback import LoopbackFixture, shell_call
from tests.daemon_harness import RunningDaemon, daemon_settings, running_daemon
from tests.supervisor_helpers import Chat
from tests.support.store_time import age_sandbox

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


def metric(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return 0.0


async def status(d: RunningDaemon, chat: Chat) -> dict:
    return (await d.client.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()


async def ok_turn(d: RunningDaemon, chat: Chat, message: str, expected: str) -> dict:
    reply = chat.expect_turn(message)
    receipt, _, _ = await d.run(chat.job(message))
    assert (receipt["context_status"], receipt["outcome"], receipt["assistant_text"]) == (expected, "succeeded", reply)
    return receipt


async def test_a_sandbox_past_its_disk_bound_is_stopped_while_others_keep_serving(tmp_path, sandbox_image,
                                                                                  docker_client) -> None:
    home = tmp_path / "home"
    with LoopbackFixture.start() as fx:
        fx.add_rules(shell_call("head -c 100000000 /dev/zero > fill.bin; sleep 60; echo written",
                                match="fill the disk", then_reply="filled"))
        settings = daemon_settings(home, fx.base_url, sandbox_image, sandbox_disk_mb=64, sweep_interval_s=1)
        x, y = Chat("codex"), Chat("codex")
        async with running_daemon(settings) as d:
            assert d.daemon.supervisor.manager.disk.quota_supported is None
            first = await ok_turn(d, x, "x1", "NEW")
            # this engine (overlay2 on ext4) refused the quota: the bound is measured
            assert d.daemon.supervisor.manager.disk.quota_supported is False
            host_config = docker_client.api.inspect_container(first["sandbox"]["container_id"])["HostConfig"]
            assert not host_config.get("StorageOpt")
            with anyio.fail_after(120):
                filling, _, _ = await d.run(x.job("fill the disk"))  # 100 MB, then a minute's sleep
            assert (filling["context_status"], filling["outcome"]) == ("LIVE", "not_settled")  # cut mid-turn
            with anyio.fail_after(30):
                while (st := await status(d, x))["sandbox"]["state"] != "stopped":
                    await anyio.sleep(0.1)
            assert (st["sandbox"]["state"], st["sandbox"]["stop_reason"]) == ("stopped", "disk_quota")
            assert st["members"][0]["resident"] is False and st["members"][0]["lost_reason"] is None
            assert docker_client.api.inspect_container(first["sandbox"]["container_id"])["State"]["Status"] == "exited"
            mark = len(fx.requests())
            refused, _, _ = await d.run(x.job("x3"))
            assert (refused["outcome"], refused["reason"], refused["context_status"]) == ("refused", "disk_quota", None)
            assert fx.requests()[mark:] == []  # refused before any CLI saw it
            # the host keeps serving every other chat meanwhile
            await ok_turn(d, y, "y1", "NEW")
            await ok_turn(d, y, "y2", "LIVE")
            metrics = (await d.client.get("/metrics")).text
            assert metric(metrics, "cloud_agent_sandbox_stops_total", cause="disk_quota") == 1
        # recovery: the operator raises the bound; the next turn's fresh scan clears the block
        async with running_daemon(settings.model_copy(update={"sandbox_disk_mb": 1024})) as d:
            receipt, _, _ = await d.run(x.job("x4 after the bound was raised"))
            assert (receipt["context_status"], receipt["outcome"]) == ("RESTORED", "succeeded")
            assert receipt["sandbox"]["container_id"] == first["sandbox"]["container_id"]
            st = await status(d, x)
            assert (st["sandbox"]["state"], st["sandbox"]["stop_reason"]) == ("running", None)


async def test_retention_removes_only_expired_sandboxes(tmp_path, sandbox_image, docker_client) -> None:
    home = tmp_path / "home"
    with LoopbackFixture.start() as fx:
        settings = daemon_settings(home, fx.base_url, sandbox_image, retain_days=1, sweep_interval_s=1)
        async with running_daemon(settings) as d:
            chats = {name: Chat("codex") for name in ("old_running", "old_stopped", "new_running", "new_stopped")}
            containers = {}
            for name, chat in chats.items():
                containers[name] = (await ok_turn(d, chat, f"{name} 1", "NEW"))["sandbox"]["container_id"]
            for name in ("old_stopped", "new_stopped"):
                c = chats[name]
                assert (await d.client.post(f"/v1/users/{c.user_id}/chats/{c.chat_id}/stop")).json() == {
                    "stopped": True}
            kept = await status(d, chats["new_running"])
            assert kept["sandbox"]["expires_at"] is not None
            for name in ("old_running", "old_stopped"):
                age_sandbox(settings.store_path, chats[name].user_id, chats[name].chat_id, days=1.5)
            with anyio.fail_after(60):
                while (await status(d, chats["old_stopped"]))["sandbox"]["state"] != "lost" or (
                        await status(d, chats["old_running"]))["sandbox"]["state"] != "lost":
                    await anyio.sleep(0.2)
            for name in ("old_running", "old_stopped"):
                st = await status(d, chats[name])
                assert (st["sandbox"]["lost_reason"], st["sandbox"]["expires_at"]) == ("retention_expired", None)
                assert [(m["lost_reason"], m["resident"]) for m in st["members"]] == [("retention_expired", False)]
                with pytest.raises(docker.errors.NotFound):
                    docker_client.api.inspect_container(containers[name])
                mark = len(fx.requests())
                refused, _, _ = await d.run(chats[name].job(f"{name} 2"))
                assert (refused["context_status"], refused["outcome"], refused["reason"]) == (
                    "LOST", "refused", "previously_lost")
                assert fx.requests()[mark:] == []
            for name, expected in (("new_running", "LIVE"), ("new_stopped", "RESTORED")):
                assert docker_client.api.inspect_container(containers[name])["Id"] == containers[name]
                st = await status(d, chats[name])
                assert st["sandbox"]["lost_reason"] is None
                await ok_turn(d, chats[name], f"{name} 2", expected)
            st = (await status(d, chats["new_running"]))["sandbox"]
            from datetime import datetime, timedelta
            assert datetime.fromisoformat(st["expires_at"]) - datetime.fromisoformat(st["last_used_at"]) == timedelta(
                days=1)
            metrics = (await d.client.get("/metrics")).text
            assert metric(metrics, "cloud_agent_sandbox_removals_total", cause="retention_expired") == 2
