"""Admission through the real daemon, engine and codex CLI: the queue is fair between users
and says so; at the queue timeout a job is a real 503 host_busy with nothing run or
committed, and its re-dispatch runs; the running-sandbox limit stops the least recently
used idle sandbox, never one with a turn in flight."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

import anyio
import pytest

from deploy.loopback import LoopbackFixture, stall
from tests.daemon_harness import RunningDaemon, daemon_settings, running_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


def user_texts_seen(fx: LoopbackFixture) -> list[str]:
    """The last user message of every conversational request, in the order the model got them."""
    out = []
    for r in fx.requests(kind="conversation"):
        users = [m.text for m in r.conversation() if m.role == "user"]
        if users:
            out.append(users[-1])
    return out


async def post(d: RunningDaemon, job: dict[str, Any], into: dict[str, Any]) -> None:
    receipt, events, resp = await d.run(job)
    into[job["message"]] = (resp, events, receipt)


async def wait_queued(d: RunningDaemon, job: dict[str, Any]) -> int:
    with anyio.fail_after(60):
        while True:
            resp = await d.client.get(f"/v1/jobs/{job['job_id']}", params={"user_id": job["user_id"]})
            if resp.status_code == 202 and resp.json().get("status") == "queued":
                return resp.json()["position"]
            await anyio.sleep(0.05)


async def wait_seen(fx: LoopbackFixture, text: str) -> None:
    with anyio.fail_after(120):
        while text not in user_texts_seen(fx):
            await anyio.sleep(0.1)


async def test_one_users_many_jobs_do_not_starve_anothers_one(tmp_path, sandbox_image) -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rules(stall(8, match="a1 holds the only slot"))
        settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, max_turns=1)
        async with running_daemon(settings) as d:
            a, b = Chat("codex"), Chat("codex")
            jobs = {"a1": a.job("a1 holds the only slot")}
            for i in (2, 3, 4):
                member = Chat("codex", user_id=a.user_id, chat_id=a.chat_id, member_id=f"m{i}")
                jobs[f"a{i}"] = member.job(f"a{i} waits")
            jobs["b1"] = b.job("b1 waits")
            results: dict[str, Any] = {}
            async with anyio.create_task_group() as tg:
                tg.start_soon(post, d, jobs["a1"], results)
                await wait_seen(fx, "a1 holds the only slot")
                positions = {}
                for name in ("a2", "a3", "a4", "b1"):
                    tg.start_soon(post, d, jobs[name], results)
                    positions[name] = await wait_queued(d, jobs[name])
            assert positions == {"a2": 1, "a3": 2, "a4": 3, "b1": 2}  # b1 joined ahead of a3 and a4
            # every job ran and succeeded, in round-robin order between the two users
            receipts = {name: results[j["message"]][2] for name, j in jobs.items()}
            assert {n: (r["outcome"], r["context_status"]) for n, r in receipts.items()} == {
                n: ("succeeded", "NEW") for n in jobs}
            ran = sorted(jobs, key=lambda n: datetime.fromisoformat(receipts[n]["started_at"]))
            assert ran == ["a1", "a2", "b1", "a3", "a4"]
            assert user_texts_seen(fx) == [jobs[n]["message"] for n in ran]
            # the stream said so: every place each job held, then its turn's events
            queued = {n: [e["position"] for e in results[j["message"]][1] if e["type"] == "queued"]
                      for n, j in jobs.items()}
            assert queued == {"a1": [], "a2": [1], "a3": [2, 3, 2, 1], "a4": [3, 4, 3, 2, 1], "b1": [2, 1]}
            for name in ("a2", "b1"):
                events = results[jobs[name]["message"]][1]
                first_other = next(i for i, e in enumerate(events) if e["type"] != "queued")
                assert all(e["type"] == "queued" for e in events[:first_other])
                assert events[first_other] == {"type": "status", "context_status": "NEW"}
            metrics = (await d.client.get("/metrics")).text
            assert "cloud_agent_queue_wait_seconds_count 5.0" in metrics
            assert "cloud_agent_queue_depth 0.0" in metrics and "cloud_agent_turns_limit 1.0" in metrics


async def test_host_busy_runs_nothing_commits_nothing_and_a_redispatch_runs(tmp_path, sandbox_image) -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rules(stall(10, match="a1 holds the only slot"))
        settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, max_turns=1, queue_timeout_s=2)
        async with running_daemon(settings) as d:
            a, b = Chat("codex"), Chat("codex")
            results: dict[str, Any] = {}
            busy_job = b.job("b1 arrives while the host is busy")
            async with anyio.create_task_group() as tg:
                tg.start_soon(post, d, a.job("a1 holds the only slot"), results)
                await wait_seen(fx, "a1 holds the only slot")
                resp = await d.client.post("/v1/jobs", json=busy_job)
                assert (resp.status_code, resp.headers["retry-after"]) == (503, "2")
                body = resp.json()
                assert (body["error"], body["detail"]["retry_after_s"], body["detail"]["position"]) == (
                    "host_busy", 2, 1)
                assert body["detail"]["waited_ms"] >= 2000
                # nothing ran, nothing was committed: no model request, no job, no chat
                assert busy_job["message"] not in user_texts_seen(fx)
                got = await d.client.get(f"/v1/jobs/{busy_job['job_id']}", params={"user_id": b.user_id})
                assert (got.status_code, got.json()) == (404, {"error": "not_found"})
                assert (await d.client.get(f"/v1/users/{b.user_id}/chats/{b.chat_id}")).status_code == 404
            assert results["a1 holds the only slot"][2]["outcome"] == "succeeded"
            reply = b.expect_turn(busy_job["message"])
            receipt, events, resp = await d.run(busy_job)  # the same job id, later: it runs
            assert resp.status_code == 200
            assert (receipt["outcome"], receipt["context_status"], receipt["assistant_text"]) == (
                "succeeded", "NEW", reply)
            assert [e["type"] for e in events if e["type"] == "queued"] == []
            assert user_texts_seen(fx) == ["a1 holds the only slot", busy_job["message"]]
            metrics = (await d.client.get("/metrics")).text
            assert "cloud_agent_host_busy_total 1.0" in metrics


async def test_the_sandbox_limit_stops_the_lru_idle_sandbox_never_one_in_a_turn(tmp_path, sandbox_image,
                                                                               docker_client) -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rules(stall(20, match="x1 is a long turn"))
        settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, max_running_sandboxes=2)
        async with running_daemon(settings) as d:
            x, y, z = Chat("codex"), Chat("codex"), Chat("codex")
            results: dict[str, Any] = {}

            def state(receipt: dict[str, Any]) -> str:
                return docker_client.api.inspect_container(receipt["sandbox"]["container_id"])["State"]["Status"]

            async with anyio.create_task_group() as tg:
                tg.start_soon(post, d, x.job("x1 is a long turn"), results)
                await wait_seen(fx, "x1 is a long turn")  # x is now the least recently used, but busy
                y1, _, _ = await d.run(y.job("y1"))
                z1, _, _ = await d.run(z.job("z1"))  # a third sandbox: y (idle) is stopped, not x
                assert (y1["outcome"], z1["outcome"]) == ("succeeded", "succeeded")
                assert (state(y1), state(z1)) == ("exited", "running")
                assert "x1 is a long turn" not in results  # x's turn was still in flight
            x1 = results["x1 is a long turn"][2]
            assert (x1["outcome"], state(x1)) == ("succeeded", "running")
            y.expect_turn("y1")
            reply = y.expect_turn("y2")
            y2, _, _ = await d.run(y.job("y2"))  # z is now the LRU idle one (x finished after z)
            assert (y2["outcome"], y2["context_status"], y2["assistant_text"]) == ("succeeded", "RESTORED", reply)
            assert (state(y2), state(z1), state(x1)) == ("running", "exited", "running")
            status = (await d.client.get(f"/v1/users/{z.user_id}/chats/{z.chat_id}")).json()
            assert status["sandbox"]["state"] == "stopped" and status["members"][0]["resident"] is False
            metrics = (await d.client.get("/metrics")).text
            assert 'cloud_agent_sandbox_stops_total{cause="sandbox_limit"} 2.0' in metrics
            assert "cloud_agent_sandboxes_running 2.0" in metrics
            assert json.dumps(y2["sandbox"]["container_id"]) == json.dumps(y1["sandbox"]["container_id"])
