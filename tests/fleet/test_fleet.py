"""A fleet of three hosts on this machine (SPEC 16), all real: a PostgreSQL cluster the test
starts (unix socket only), three ``dockerd`` with their own data and exec roots, three
daemons, the pinned Codex CLI against the loopback fixture.

The cases run in order on one fleet (module scope) because the last ones take hosts away:
placement and forwarding, one job id dispatched 32 times over three hosts, PostgreSQL
restarted under load, a partitioned host (heartbeat paused: its late commit is refused),
and a killed host (its chats LOST ``host_lost`` everywhere, new chats on live hosts).
"""

from __future__ import annotations

import json
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
import psycopg
import pytest
from psycopg.rows import dict_row

from deploy.loopback import LoopbackFixture, stall
from tests.supervisor_helpers import Chat
from tests.support.fleet import Engine, Host, docker_cli, engines, fleet_hosts, ndjson
from tests.support.postgres import Cluster, pg_cluster

pytestmark = [pytest.mark.fleet, pytest.mark.docker, pytest.mark.cli, pytest.mark.anyio]

RUNTIME = "codex"  # one fast CLI is enough for the multi-host cases
LEASE_TTL_S = 20.0  # rides out a PostgreSQL restart on a loaded machine


@dataclass
class FleetUnderTest:
    pg: Cluster
    store_url: str
    fx: LoopbackFixture
    hosts: list[Host]
    engines: list[Engine]

    def rows(self, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        with psycopg.connect(self.store_url, row_factory=dict_row) as conn:
            return list(conn.execute(sql, params))

    def owner(self, chat: Chat) -> Host:
        rows = self.rows("SELECT host_id FROM placements WHERE user_id=%s AND chat_id=%s", (chat.user_id, chat.chat_id))
        assert len(rows) == 1, rows
        return next(h for h in self.hosts if h.host_id == rows[0]["host_id"])

    def containers(self, host: Host) -> set[str]:
        return set(docker_cli(host.engine.url, "ps", "-aq", "--no-trunc").stdout.split())

    def conversation_requests_with(self, text: str) -> int:
        """Model requests whose latest user message carries ``text``."""
        return sum(1 for r in self.fx.requests(kind="conversation") if text in last_user_text(r))


def last_user_text(request: Any) -> str:
    users = [m.text for m in request.conversation() if m.role == "user"]
    return users[-1] if users else ""


@pytest.fixture(scope="module")
def fleet(sandbox_image, tmp_path_factory):
    with pg_cluster() as pg, LoopbackFixture.start() as fx, engines(3, sandbox_image) as engs:
        url = pg.create_database("fleet")
        root = tmp_path_factory.mktemp("fleet")
        with fleet_hosts(engs, store_url=url, gateway_url=fx.base_url, image=sandbox_image, root=root,
                         lease_ttl_s=LEASE_TTL_S) as hosts:
            yield FleetUnderTest(pg, url, fx, hosts, engs)


async def post_job(host: Host, job: dict[str, Any]) -> tuple[int, dict[str, str], list[dict[str, Any]]]:
    async with host.client() as client:
        resp = await client.post("/v1/jobs", json=job)
        body = resp.text
    events = ndjson(body) if resp.headers.get("content-type", "").startswith("application/x-ndjson") else [resp.json()]
    return resp.status_code, dict(resp.headers), events


def receipt_of(events: list[dict[str, Any]]) -> dict[str, Any] | None:
    return next((e["receipt"] for e in events if e.get("type") == "receipt"), None)


async def test_placement_spreads_new_chats_and_forwards_to_the_owner(fleet: FleetUnderTest) -> None:
    entry = fleet.hosts[0]
    chats = [Chat(RUNTIME) for _ in range(3)]
    for chat in chats:  # every first job goes to host 0; the chats land on all three hosts
        message = f"hello from {chat.chat_id}"
        reply = chat.expect_turn(message)
        status, _, events = await post_job(entry, chat.job(message))
        assert status == 200, events
        assert (events[0]["type"], events[-1]["type"]) == ("status", "receipt"), events
        assert {e["type"] for e in events[1:-1]} <= {"event"}, events
        receipt = receipt_of(events)
        assert (receipt["context_status"], receipt["outcome"], receipt["assistant_text"]) == ("NEW", "succeeded", reply)
        owner = fleet.owner(chat)
        # it ran on the owner: the container exists in the owner's engine and nowhere else
        assert [receipt["sandbox"]["container_id"] in fleet.containers(h) for h in fleet.hosts] == \
            [h is owner for h in fleet.hosts]
    assert [fleet.owner(c).name for c in chats] == ["host0", "host1", "host2"]
    hosts = {r["host_id"]: r for r in fleet.rows("SELECT * FROM hosts")}
    assert sorted(hosts) == sorted(h.host_id for h in fleet.hosts)
    assert {r["api_url"] for r in hosts.values()} == {h.url for h in fleet.hosts}

    # the second turn of host1's chat, sent to host2: forwarded, LIVE on host1's resident process
    chat = chats[1]
    message = "second turn, through another host"
    reply = chat.expect_turn(message)
    status, headers, events = await post_job(fleet.hosts[2], chat.job(message))
    assert status == 200 and headers["content-type"].startswith("application/x-ndjson")
    assert events[0] == {"type": "status", "context_status": "LIVE"}
    assert [e["text"] for e in events if e.get("kind") == "text"] and events[-1]["type"] == "receipt"
    receipt = receipt_of(events)
    assert (receipt["context_status"], receipt["assistant_text"]) == ("LIVE", reply)
    # GET routes work from any host: the receipt from host0, the chat (forwarded to host1) from host2
    async with fleet.hosts[0].client() as c0, fleet.hosts[2].client() as c2:
        got = await c0.get(f"/v1/jobs/{receipt['job_id']}", params={"user_id": chat.user_id})
        assert got.status_code == 200 and got.json() == receipt
        status_doc = (await c2.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()
        assert [(m["member_id"], m["settled_turns"], m["resident"]) for m in status_doc["members"]] == \
            [("m1", 2, True)]  # only the owner knows its residents: this answer came from host1


async def test_one_job_id_dispatched_32_times_over_three_hosts_runs_once(fleet: FleetUnderTest) -> None:
    chat = Chat(RUNTIME)
    message = f"only once {uuid.uuid4().hex[:8]}"
    fleet.fx.add_rules(stall(4.0, match=message))  # long enough for every dispatch to overlap
    job = chat.job(message)
    answers: list[tuple[int, dict[str, str], list[dict[str, Any]]]] = []

    async def dispatch(i: int) -> None:
        answers.append(await post_job(fleet.hosts[i % 3], job))

    async with anyio.create_task_group() as tg:
        for i in range(32):
            tg.start_soon(dispatch, i)
    ran = [a for a in answers if a[0] == 200 and a[2][0].get("type") == "status"]
    assert len(ran) == 1, [a[2] for a in answers]
    the_receipt = receipt_of(ran[0][2])
    assert the_receipt["outcome"] == "succeeded"
    kinds = Counter()
    for status, headers, events in answers:
        if status == 409:
            assert events == [{"error": "job_running", "detail": "this job_id is still running"}]
            kinds["job_running"] += 1
        elif events[0].get("type") == "receipt":
            assert headers.get("x-job-replayed") == "true" and receipt_of(events) == the_receipt
            kinds["replayed"] += 1
        else:
            kinds["ran"] += 1
    assert kinds["ran"] == 1 and kinds["job_running"] + kinds["replayed"] == 31
    assert fleet.conversation_requests_with(message) == 1  # one run of the CLI
    jobs = fleet.rows("SELECT state, receipt_json FROM jobs WHERE user_id=%s AND job_id=%s",
                      (chat.user_id, job["job_id"]))
    assert [j["state"] for j in jobs] == ["done"] and json.loads(jobs[0]["receipt_json"]) == the_receipt
    member = fleet.rows("SELECT settled_turns FROM members WHERE user_id=%s AND chat_id=%s",
                        (chat.user_id, chat.chat_id))
    assert [m["settled_turns"] for m in member] == [1]  # one commit


async def test_postgres_restarted_under_load_doubles_nothing(fleet: FleetUnderTest) -> None:
    chats = [Chat(RUNTIME) for _ in range(3)]
    jobs = [c.job(f"load {i} {uuid.uuid4().hex[:6]}") for i, c in enumerate(chats) for _ in range(1)]
    jobs += [c.job(f"load again {i} {uuid.uuid4().hex[:6]}") for i, c in enumerate(chats)]
    answers: dict[str, tuple[int, list[dict[str, Any]]]] = {}

    async def run_chat(i: int) -> None:
        for job in (jobs[i], jobs[i + 3]):  # a chat's turns one after another; chats concurrently
            try:
                status, _, events = await post_job(fleet.hosts[i], job)
            except httpx.HTTPError as exc:
                status, events = 0, [{"error": type(exc).__name__}]
            answers[job["job_id"]] = (status, events)

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(run_chat, i)
        await anyio.sleep(3.0)
        t = anyio.current_time()
        await anyio.to_thread.run_sync(fleet.pg.restart)
        print(f"PostgreSQL restart took {anyio.current_time() - t:.1f} s")
    outcomes = Counter()
    for job in jobs:
        status, events = answers[job["job_id"]]
        receipt = receipt_of(events)
        if receipt is not None:
            outcomes["receipt"] += 1
            assert receipt["outcome"] in ("succeeded", "refused", "not_settled"), receipt
        else:  # a clear reason, never a bare 500
            reason = events[-1].get("error")
            assert reason in ("store_unavailable", "host_unreachable"), (status, events)
            outcomes[reason] += 1
        # none doubled: the CLI saw each message at most once, the store holds the job at most once
        assert fleet.conversation_requests_with(job["message"]) <= 1, job
        assert len(fleet.rows("SELECT 1 FROM jobs WHERE user_id=%s AND job_id=%s",
                              (job["user_id"], job["job_id"]))) <= 1
    # afterwards every job id answers consistently: its recorded receipt, or it runs now, once.
    # A host's connection pool can still answer store_unavailable for a while after the server
    # is back (measured in CI: a 10 s PoolTimeout after a 0.3 s restart, the pool's reconnect
    # backoff); that answer is clear and ran nothing, so the job is sent again until it is served.
    for i, job in enumerate(jobs):
        served_by = anyio.current_time() + 60
        while True:
            status, _, events = await post_job(fleet.hosts[(i + 1) % 3], job)
            if (status, events[-1].get("error")) != (503, "store_unavailable") or anyio.current_time() > served_by:
                break
            await anyio.sleep(1.0)
        assert status in (200, 409), events
        if status == 200:
            assert fleet.conversation_requests_with(job["message"]) <= 1
    assert sum(outcomes.values()) == 6, outcomes


async def test_paused_heartbeat_late_commit_is_refused(fleet: FleetUnderTest) -> None:
    chat = Chat(RUNTIME)
    chat.expect_turn("first turn")
    status, _, events = await post_job(fleet.hosts[0], chat.job("first turn"))
    first = receipt_of(events)
    assert first["outcome"] == "succeeded", events
    owner = fleet.owner(chat)
    others = [h for h in fleet.hosts if h is not owner]
    message = f"slow turn {uuid.uuid4().hex[:6]}"
    fleet.fx.add_rules(stall(LEASE_TTL_S + 6, match=message))
    job = chat.job(message)
    result: dict[str, Any] = {}

    async def run() -> None:
        result["answer"] = await post_job(owner, job)

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.to_thread.run_sync(lambda: fleet.fx.wait_for(
            lambda reqs: any(message in last_user_text(r) for r in reqs if r.kind == "conversation"),
            timeout=120))
        owner.pause_heartbeat()  # partitioned: its lease runs out while the model is still answering
    status, _, events = result["answer"]
    assert events[-1] == {"type": "error", "error": "host_fenced",
                          "detail": "this host's lease expired during the turn: the store refused its commit"}
    assert receipt_of(events) is None
    member = fleet.rows("SELECT locator_id, settled_turns FROM members WHERE user_id=%s AND chat_id=%s",
                        (chat.user_id, chat.chat_id))
    assert member == [{"locator_id": first["locator_after"], "settled_turns": 1}]  # the late commit wrote nothing
    async with others[0].client() as c:
        got = (await c.get(f"/v1/jobs/{job['job_id']}", params={"user_id": chat.user_id})).json()
    assert (got["outcome"], got["reason"]) == ("not_settled", "host_lost")
    # its chats answer LOST host_lost on every other host; the model never sees those turns
    for h in others:
        probe = f"after the partition via {h.name}"
        status, _, events = await post_job(h, chat.job(probe))
        receipt = receipt_of(events)
        assert (status, receipt["context_status"], receipt["outcome"], receipt["reason"]) == \
            (200, "LOST", "refused", "host_lost")
        assert fleet.conversation_requests_with(probe) == 0
    # the fenced host accepts no work, says so, and no new chat is placed on it
    status, _, events = await post_job(owner, Chat(RUNTIME).job("new chat to a fenced host"))
    assert (status, events[-1]["error"]) == (503, "host_fenced")
    async with owner.client() as c:
        ready = await c.get("/readyz")
    assert ready.status_code == 503 and "host_fenced" in ready.json()["reasons"]
    for _ in range(2):
        status, _, events = await post_job(others[0], (c := Chat(RUNTIME)).job("placed elsewhere"))
        assert status == 200 and fleet.owner(c) is not owner


async def test_killed_owner_host_loses_its_chats_everywhere(fleet: FleetUnderTest) -> None:
    live = [h for h in fleet.hosts if not h.pause_file.exists()]
    assert len(live) == 2
    chat = Chat(RUNTIME)
    # place it on the first live host: send there, the chat goes to the most free live host
    status, _, events = await post_job(live[0], chat.job("before the crash"))
    assert receipt_of(events)["outcome"] == "succeeded", events
    victim = fleet.owner(chat)
    survivor = next(h for h in live if h is not victim)
    victim.kill()  # daemon and engine, SIGKILL
    status, headers, events = await post_job(survivor, chat.job("while its lease still runs"))
    assert (status, events[-1]["error"]) == (503, "host_unreachable") and int(headers["retry-after"]) >= 1
    await anyio.sleep(LEASE_TTL_S + 1)
    job = chat.job("after the lease expired")
    status, headers, events = await post_job(survivor, job)
    receipt = receipt_of(events)
    assert (status, receipt["context_status"], receipt["outcome"], receipt["reason"]) == \
        (200, "LOST", "refused", "host_lost")
    assert fleet.conversation_requests_with("after the lease expired") == 0
    again = await post_job(survivor, job)  # the job fence holds for host_lost answers too
    assert again[1].get("x-job-replayed") == "true" and receipt_of(again[2]) == receipt
    async with survivor.client() as c:
        doc = (await c.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()
        assert (doc["sandbox"]["state"], doc["sandbox"]["lost_reason"]) == ("lost", "host_lost")
        assert [m["lost_reason"] for m in doc["members"]] == ["host_lost"]
        stop = await c.post(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}/stop")
        assert (stop.status_code, stop.json()["error"]) == (409, "host_lost")
    # new chats go to the live host
    for _ in range(2):
        fresh = Chat(RUNTIME)
        status, _, events = await post_job(survivor, fresh.job("a new chat after the crash"))
        assert status == 200 and receipt_of(events)["outcome"] == "succeeded"
        assert fleet.owner(fresh) is survivor
