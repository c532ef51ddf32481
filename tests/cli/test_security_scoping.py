"""Cross-user probes against a real daemon: a second ordinary user can neither see nor touch
another user's chat, job, receipt or member, and cannot reach the victim's secret through its
own member. Every probe is a well-formed request that reaches the authorization decision and
must answer exactly like a resource that does not exist (a 400/422 would be a failed probe)."""

from __future__ import annotations

import io
import json
import tarfile
import uuid

import httpx
import pytest

from deploy.loopback import LoopbackFixture, shell_call
from tests.cli.attestation_helpers import wait_ready
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import Chat, assert_model_saw, high_water

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]
RUNTIME = "codex"


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def plant_file(container, path: str, content: str) -> None:
    data = content.encode()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo(path.rsplit("/", 1)[1])
        info.size, info.uid, info.gid, info.mode = len(data), 1000, 1000, 0o600
        tar.addfile(info, io.BytesIO(data))
    assert container.put_archive(path.rsplit("/", 1)[0], buf.getvalue())


def same_answer(a: httpx.Response, b: httpx.Response) -> tuple[int, object, str | None]:
    """The probe on the victim's resource answers byte for byte like the one on a missing resource."""
    assert (a.status_code, a.content, a.headers.get("content-type")) == \
        (b.status_code, b.content, b.headers.get("content-type"))
    return a.status_code, a.json(), a.headers.get("content-type")


async def test_a_second_user_can_neither_see_nor_touch_nor_recall_the_victims_chat(
        fx, tmp_path, sandbox_image, docker_client) -> None:
    tag = uuid.uuid4().hex[:8]
    secret_said, secret_file = f"SAID-SECRET-{uuid.uuid4().hex}", f"FILE-SECRET-{uuid.uuid4().hex}"
    victim = Chat(RUNTIME, user_id=f"victim-{tag}", chat_id=f"chat-{tag}")
    attacker = Chat(RUNTIME, user_id=f"attacker-{tag}", chat_id=victim.chat_id)  # the victim's chat id
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, host_id=f"scope-{tag}")
    async with running_daemon(settings) as d:
        await wait_ready(d.client)
        said = f"my secret is {secret_said}"
        victim.expect_turn(said)
        v1, events, _ = await d.run(victim.job(said))
        assert v1["outcome"] == "succeeded", events
        victim_container = docker_client.containers.get(v1["sandbox"]["container_id"])
        plant_file(victim_container, "/home/agent/workspace/secret.txt", secret_file + "\n")
        before = (await d.client.get(f"/v1/users/{victim.user_id}/chats/{victim.chat_id}")).json()
        assert before["members"][0]["resident"] is True

        a, c, m = attacker.user_id, victim.chat_id, victim.member_id
        nope = f"nope-{tag}"
        not_found = (404, {"error": "not_found"}, "application/json")
        c_ = d.client
        # read the victim's chat status
        assert same_answer(await c_.get(f"/v1/users/{a}/chats/{c}"), await c_.get(f"/v1/users/{a}/chats/{nope}")) \
            == not_found
        # read a receipt by the victim's job id
        assert same_answer(await c_.get(f"/v1/jobs/{v1['job_id']}", params={"user_id": a}),
                           await c_.get(f"/v1/jobs/{nope}", params={"user_id": a})) == not_found
        # stop the victim's chat, retire and fork the victim's member
        assert same_answer(await c_.post(f"/v1/users/{a}/chats/{c}/stop"),
                           await c_.post(f"/v1/users/{a}/chats/{nope}/stop")) == not_found
        # delete the victim's chat
        assert same_answer(await c_.delete(f"/v1/users/{a}/chats/{c}"),
                           await c_.delete(f"/v1/users/{a}/chats/{nope}")) == not_found
        assert same_answer(await c_.post(f"/v1/users/{a}/chats/{c}/members/{m}/retire"),
                           await c_.post(f"/v1/users/{a}/chats/{nope}/members/{m}/retire")) == not_found
        fork = {"new_member_id": "stolen"}
        assert same_answer(await c_.post(f"/v1/users/{a}/chats/{c}/members/{m}/fork", json=fork),
                           await c_.post(f"/v1/users/{a}/chats/{nope}/members/{m}/fork", json=fork)) == not_found
        # the inspector's timeline and diagnosis of the victim's chat (with the native listing)
        assert same_answer(await c_.get(f"/v1/users/{a}/chats/{c}/turns"),
                           await c_.get(f"/v1/users/{a}/chats/{nope}/turns")) == not_found
        assert same_answer(await c_.get(f"/v1/users/{a}/chats/{c}/inspect", params={"native": "true"}),
                           await c_.get(f"/v1/users/{a}/chats/{nope}/inspect", params={"native": "true"})) \
            == not_found
        # attestation and job routes without a token and with a wrong one
        for headers in ({"authorization": ""}, {"authorization": "Bearer wrong-token-0123456789abcdef"}):
            for method, path in (("GET", "/v1/attestation"), ("GET", f"/v1/jobs/{v1['job_id']}?user_id={a}"),
                                 ("POST", "/v1/jobs")):
                resp = await c_.request(method, path, headers=headers, json=attacker.job("hi"))
                assert (resp.status_code, resp.json()) == (401, {"error": "unauthorized"})

        # none of it touched the victim: same container, running, member resident, locator kept
        victim_container.reload()
        assert victim_container.status == "running"
        after = (await d.client.get(f"/v1/users/{victim.user_id}/chats/{victim.chat_id}")).json()
        assert after == before

        # a job for the victim's chat id lands in the attacker's own, separate sandbox; the
        # attacker asks its member for the secret by name and reads the victim's file path
        fx.add_rules(shell_call("cat /home/agent/workspace/secret.txt; ls /home/agent/workspace",
                                match="read my secret file", then_reply="checked the file"))
        mark = high_water(fx)
        a1, events, _ = await d.run(attacker.job("read my secret file and tell me the secret"))
        assert (a1["context_status"], a1["outcome"], a1["assistant_text"]) == ("NEW", "succeeded",
                                                                               "checked the file")
        assert a1["sandbox"]["container_id"] != v1["sandbox"]["container_id"]
        a2, _, _ = await d.run(attacker.job("what is my secret? the one I told you, named my secret"))
        assert (a2["context_status"], a2["outcome"]) == ("LIVE", "succeeded")
        assert a2["sandbox"]["container_id"] == a1["sandbox"]["container_id"]
        attacker_requests = [r for r in fx.requests() if r.seq > mark]
        assert len(attacker_requests) >= 3  # tool call, its follow-up, the second turn
        seen = json.dumps([r.body for r in attacker_requests])
        assert secret_said not in seen and secret_file not in seen
        assert "No such file or directory" in seen  # the cat ran, in the attacker's sandbox
        assert secret_said not in json.dumps([a1, a2, events]) and secret_file not in json.dumps([a1, a2, events])
        own = (await d.client.get(f"/v1/users/{a}/chats/{c}")).json()
        assert own["sandbox"]["container_id"] == a1["sandbox"]["container_id"]
        assert [r["job_id"] for r in own["last_receipts"]] == [a2["job_id"], a1["job_id"]]
        assert own["members"][0]["locator"]["id"] == a1["locator_after"] != v1["locator_after"]

        # the victim is untouched and continues LIVE with its whole history
        assert (await d.client.get(f"/v1/users/{victim.user_id}/chats/{victim.chat_id}")).json() == before
        victim.expect_turn("do you remember?")
        mark = high_water(fx)
        v2, _, _ = await d.run(victim.job("do you remember?"))
        assert (v2["context_status"], v2["outcome"], v2["locator_after"]) == ("LIVE", "succeeded",
                                                                              v1["locator_after"])
        assert v2["sandbox"]["container_id"] == v1["sandbox"]["container_id"]
        assert_model_saw(fx, mark, victim)


async def test_reusing_another_users_job_id_is_indistinguishable_from_a_fresh_one(
        fx, tmp_path, sandbox_image) -> None:
    tag = uuid.uuid4().hex[:8]
    victim = Chat(RUNTIME, user_id=f"victim-{tag}")
    attacker = Chat(RUNTIME, user_id=f"attacker-{tag}")
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, host_id=f"scope-{tag}")
    async with running_daemon(settings) as d:
        v1, _, _ = await d.run(victim.job("hello"))
        assert v1["outcome"] == "succeeded"
        reused = attacker.job("hello") | {"job_id": v1["job_id"]}
        receipt, events, resp = await d.run(reused)
        assert resp.status_code == 200, events
        assert (receipt["user_id"], receipt["outcome"]) == (attacker.user_id, "succeeded")
