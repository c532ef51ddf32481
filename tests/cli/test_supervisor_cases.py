"""Issue 5 acceptance, runtime-independent cases (driven with Codex, the fastest CLI to start):
LOST refusals, daemon restart, the job fence, kill -9 mid-turn, bad input."""

from __future__ import annotations

import json
import sqlite3

import anyio
import httpx
import pytest

from deploy.loopback import LoopbackFixture, stall
from sandbox_manager.identity import LABEL_IDENTITY
from state.store import Store
from tests.daemon_harness import TOKEN, daemon_process, daemon_settings, running_daemon
from tests.supervisor_helpers import Chat, assert_model_saw, high_water
from tests.support.store import erase_locator, rows

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]
RUNTIME = "codex"


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


async def two_turns(d, chat: Chat, fx) -> dict:
    receipt = None
    for msg in ("first question", "second question"):
        chat.expect_turn(msg)
        receipt, events, _ = await d.run(chat.job(msg))
        assert receipt["outcome"] == "succeeded", events
    return receipt


async def assert_refused(d, fx, chat: Chat, reason: str, status: str = "LOST", **job_extra) -> dict:
    mark = high_water(fx)
    receipt, _, resp = await d.run(chat.job("this must never reach a model", **job_extra))
    assert resp.status_code == 200
    assert (receipt["context_status"], receipt["outcome"], receipt["reason"]) == (status, "refused", reason)
    assert [r for r in fx.requests() if r.seq > mark] == [], "a refused turn must not reach the model"
    return receipt


async def test_lost_cases(fx, tmp_path, sandbox_image, docker_client) -> None:
    async with running_daemon(daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)) as d:
        # labels tampered: the recorded container is replaced by one with forged identity labels
        chat = Chat(RUNTIME)
        last = await two_turns(d, chat, fx)
        cid = last["sandbox"]["container_id"]
        name = docker_client.containers.get(cid).name
        image = docker_client.containers.get(cid).image.id
        docker_client.api.remove_container(cid, force=True)
        forged = docker_client.containers.create(image, name=name, init=True, labels={LABEL_IDENTITY: "forged"},
                                                 network_mode="none")
        store: Store = d.daemon.supervisor.store
        rec = await store.get_sandbox(chat.user_id, chat.chat_id)
        await store.put_sandbox(rec.model_copy(update={"container_id": forged.id}))
        await assert_refused(d, fx, chat, "labels_mismatch")
        await assert_refused(d, fx, chat, "previously_lost")  # LOST stays LOST
        forged.remove(force=True)

        # a member with settled turns whose locator was erased from the store
        chat = Chat(RUNTIME)
        last = await two_turns(d, chat, fx)
        erase_locator(store, chat.user_id, chat.chat_id, chat.member_id)
        await d.client.post(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}/members/{chat.member_id}/retire")
        await assert_refused(d, fx, chat, "member_locator_missing")

        # a job naming a locator other than the saved one: rejected before any process starts,
        # with the member's real status (its resident process serves the next turn: LIVE, SPEC 3)
        chat = Chat(RUNTIME)
        last = await two_turns(d, chat, fx)
        saved = last["locator_after"]
        r = await assert_refused(d, fx, chat, "locator_mismatch", status="LIVE",
                                 locator="01a20000-0000-7000-8000-000000000000")
        assert r["locator_before"] == saved and r["locator_after"] == saved
        member = (await d.client.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()["members"][0]
        assert (member["lost_reason"], member["resident"], member["settled_turns"]) == (None, True, 2)
        # naming the saved locator explicitly works (and the member was not marked lost)
        chat.expect_turn("third question")
        mark = high_water(fx)
        receipt, _, _ = await d.run(chat.job("third question", locator=saved))
        assert (receipt["context_status"], receipt["outcome"]) == ("LIVE", "succeeded")
        assert_model_saw(fx, mark, chat)


async def test_daemon_restart_keeps_the_resident_live_with_full_history(fx, tmp_path, sandbox_image) -> None:
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)
    chat = Chat(RUNTIME)
    async with running_daemon(settings) as d:
        first = await two_turns(d, chat, fx)
    async with running_daemon(settings) as d:
        chat.expect_turn("after the daemon restarted")
        mark = high_water(fx)
        receipt, _, _ = await d.run(chat.job("after the daemon restarted"))
        # SPEC 14: the resident outlived the graceful shutdown under its keeper
        assert (receipt["context_status"], receipt["outcome"]) == ("LIVE", "succeeded")
        assert receipt["locator_after"] == first["locator_after"]
        assert_model_saw(fx, mark, chat)


async def test_duplicate_job_ids_sequential_and_concurrent(fx, tmp_path, sandbox_image) -> None:
    async with running_daemon(daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)) as d:
        chat = Chat(RUNTIME)
        chat.expect_turn("only once")
        job = chat.job("only once")
        first, _, _ = await d.run(job)
        assert first["outcome"] == "succeeded"
        n = len(fx.requests(kind="conversation"))
        again, events, resp = await d.run(job)
        assert again == first and len(events) == 1 and resp.headers.get("x-job-replayed") == "true"
        assert len(fx.requests(kind="conversation")) == n
        changed = dict(job, message="another body")
        resp = await d.client.post("/v1/jobs", json=changed)
        assert (resp.status_code, resp.json()["error"]) == (409, "job_conflict")
        fetched = await d.client.get(f"/v1/jobs/{job['job_id']}", params={"user_id": chat.user_id})
        assert fetched.json() == first

        # 7 dispatches of a job id while it runs (its turn held in the fixture): each is told
        # job_running; exactly one execution, one 200 stream carrying the receipt
        chat.expect_turn("eight at once")
        job = chat.job("eight at once")
        n = len(fx.requests(kind="conversation"))
        fx.add_rule(stall(600, match="eight at once", times=1, id="hold-first"))
        results: list[tuple[int, object]] = []

        async def dispatch() -> None:
            async with d.client.stream("POST", "/v1/jobs", json=job) as resp:
                body = [json.loads(line) async for line in resp.aiter_lines() if line.strip()]
                results.append((resp.status_code, body))

        async with anyio.create_task_group() as tg:
            tg.start_soon(dispatch)
            await anyio.to_thread.run_sync(lambda: fx.wait_for(
                lambda rs: any("eight at once" in json.dumps(r.body) for r in rs), timeout=120))
            async with anyio.create_task_group() as again:
                for _ in range(7):
                    again.start_soon(dispatch)
            fx.release_stalls()
        assert [s for s, _ in results] == [409] * 7 + [200]
        assert all(b == [{"error": "job_running", "detail": "this job_id is still running"}] for _, b in results[:7])
        ran = results[-1][1]
        assert ran[-1]["type"] == "receipt" and ran[-1]["receipt"]["outcome"] == "succeeded"
        assert len(fx.requests(kind="conversation")) == n + 1
        jobs = [r for r in rows(d.daemon.supervisor.store, "jobs") if r["job_id"] == job["job_id"]]
        assert len(jobs) == 1 and jobs[0]["state"] == "done"


async def test_a_job_queued_behind_its_members_turn_reads_what_that_turn_committed(fx, tmp_path,
                                                                                    sandbox_image) -> None:
    """The claim reads the member in its own transaction (issue 16). A job claimed while
    another turn of its member runs must not keep that read: under the member's lock it reads
    the member again, so its turn is numbered after the one it waited for, and the model sees
    the whole history in order."""
    async with running_daemon(daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)) as d:
        store = d.daemon.supervisor.store
        chat = Chat(RUNTIME)
        chat.expect_turn("first question")
        first, _, _ = await d.run(chat.job("first question"))
        assert (first["context_status"], first["outcome"]) == ("NEW", "succeeded")
        held, queued = chat.job("hold this turn"), chat.job("queued behind it")
        chat.expect_turn("hold this turn")
        chat.expect_turn("queued behind it")
        fx.add_rule(stall(600, match="hold this turn", times=1, id="hold"))
        receipts: dict[str, dict] = {}

        async def run(name: str, job: dict) -> None:
            receipts[name] = (await d.run(job))[0]

        def claimed(job_id: str) -> bool:
            return any(r["job_id"] == job_id and r["state"] == "running" for r in rows(store, "jobs"))

        mark = high_water(fx)
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, "held", held)
            await anyio.to_thread.run_sync(lambda: fx.wait_for(
                lambda rs: any("hold this turn" in json.dumps(r.body) for r in rs), timeout=120))
            tg.start_soon(run, "queued", queued)
            with anyio.fail_after(60):
                while not claimed(queued["job_id"]):  # claimed (and its member read) while "held" runs
                    await anyio.sleep(0.02)
            fx.release_stalls()
        assert [(receipts[k]["context_status"], receipts[k]["outcome"]) for k in ("held", "queued")] == [
            ("LIVE", "succeeded"), ("LIVE", "succeeded")]
        turns = sorted((r["settled_index"], r["job_id"]) for r in rows(store, "wire_turns")
                       if r["user_id"] == chat.user_id)
        assert turns == [(1, first["job_id"]), (2, held["job_id"]), (3, queued["job_id"])]
        assert receipts["queued"]["wire"]["history"] == "complete"
        assert_model_saw(fx, mark, chat)


async def test_kill_9_mid_turn_leaves_whole_turn_or_none(fx, tmp_path, sandbox_image, docker_client) -> None:
    home = tmp_path / "home"
    chat = Chat(RUNTIME)
    headers = {"authorization": f"Bearer {TOKEN}"}
    with daemon_process(home, fx.base_url, sandbox_image) as dp:
        async with httpx.AsyncClient(base_url=dp.url, headers=headers, timeout=120) as client:
            for msg in ("before the crash",):
                chat.expect_turn(msg)
                resp = await client.post("/v1/jobs", json=chat.job(msg))
                receipt = json.loads(resp.text.strip().splitlines()[-1])["receipt"]
                assert receipt["outcome"] == "succeeded"
            saved = receipt["locator_after"]
            # the model proxy outlives the daemon (SPEC 14): the held reply plays out in full,
            # so the hold only has to outlast the checks below and the next daemon's start
            fx.add_rule(stall(8, match="during the crash"))
            crash_reply = chat.expect_turn("during the crash")
            crash_job = chat.job("during the crash")

            async def doomed() -> None:
                try:
                    await client.post("/v1/jobs", json=crash_job)
                except httpx.HTTPError:
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                await anyio.to_thread.run_sync(lambda: fx.wait_for(
                    lambda rs: any("during the crash" in json.dumps(r.body) for r in rs), timeout=60))
                dp.kill9()
    # the store: the first turn whole, the crashed one not committed
    db = sqlite3.connect(home / "store.db")
    db.row_factory = sqlite3.Row
    member = dict(db.execute("SELECT * FROM members").fetchone())
    assert (member["settled_turns"], member["locator_id"]) == (1, saved)
    job = dict(db.execute("SELECT * FROM jobs WHERE job_id=?", (crash_job["job_id"],)).fetchone())
    assert (job["state"], job["receipt_json"]) == ("running", None)
    db.close()
    fx.set_rules([])
    # The resident lives on under its keeper (SPEC 14); a process no keeper record owns (a
    # server child, a wedged process) stays behind too. Plant such an orphan the way the
    # daemon once launched processes: through ca-launch, with a pidfile in a member run dir.
    container = docker_client.containers.get(receipt["sandbox"]["container_id"])
    container.exec_run(["ca-launch", "--pidfile", "/home/agent/members/orphan/run/cli.pid", "--",
                        "sh", "-c", "sleep 1000 & exec sleep 1001"], user="agent", detach=True)
    with anyio.fail_after(10):
        while "1001" not in container.exec_run(["ps", "-eo", "args="]).output.decode():
            await anyio.sleep(0.1)
    with daemon_process(home, fx.base_url, sandbox_image) as dp:
        # the restarted daemon killed the orphaned process group in the retained sandbox
        comms = container.exec_run(["ps", "-eo", "stat=,args="]).output.decode().split("\n")
        assert not [c for c in comms if "sleep 100" in c], comms
        assert not [c for c in comms if c.strip().startswith("Z")], comms
        async with httpx.AsyncClient(base_url=dp.url, headers=headers, timeout=120) as client:
            # the new daemon finished the crashed turn on the re-adopted keeper (SPEC 14)
            with anyio.fail_after(120):
                while (resp := await client.get(f"/v1/jobs/{crash_job['job_id']}",
                                                params={"user_id": chat.user_id})).status_code == 202:
                    await anyio.sleep(0.2)
            got = resp.json()
            assert (got["outcome"], got["context_status"], got["assistant_text"]) == ("succeeded", "LIVE",
                                                                                      crash_reply)
            # the same job id never runs again
            resp = await client.post("/v1/jobs", json=crash_job)
            assert json.loads(resp.text.strip())["receipt"] == got
            # the next turn is LIVE on the same process; the model sees each message once
            chat.expect_turn("after the crash")
            mark = high_water(fx)
            resp = await client.post("/v1/jobs", json=chat.job("after the crash"))
            receipt = json.loads(resp.text.strip().splitlines()[-1])["receipt"]
            assert (receipt["context_status"], receipt["outcome"]) == ("LIVE", "succeeded")
            assert receipt["locator_before"] == saved == receipt["locator_after"]
            assert_model_saw(fx, mark, chat)


@pytest.mark.parametrize(("patch", "field"), [
    ({"runtime": "gpt"}, "runtime"),
    ({"user_id": ""}, "user_id"),
    ({"chat_id": "../etc"}, "chat_id"),
    ({"member_id": "a;rm -rf /"}, "member_id"),
    ({"job_id": "x y"}, "job_id"),
    ({"message": ""}, "message"),
    ({"unknown": 1}, "unknown"),
])
async def test_bad_input_names_the_field(patch, field, fx, tmp_path, sandbox_image) -> None:
    async with running_daemon(daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)) as d:
        job = {**Chat(RUNTIME).job("hi"), **patch}
        resp = await d.client.post("/v1/jobs", json=job)
        assert resp.status_code == 422
        assert field in [f["field"] for f in resp.json()["detail"]]
        assert rows(d.daemon.supervisor.store, "jobs") == []
        assert rows(d.daemon.supervisor.store, "sandboxes") == []
        missing = {k: v for k, v in Chat(RUNTIME).job("hi").items() if k != "member_id"}
        resp = await d.client.post("/v1/jobs", json=missing)
        assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "member_id"


async def test_oversized_message_is_rejected(fx, tmp_path, sandbox_image) -> None:
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, max_message_bytes=1000)
    async with running_daemon(settings) as d:
        resp = await d.client.post("/v1/jobs", json=Chat(RUNTIME).job("x" * 1001))
        assert resp.status_code == 422 and resp.json()["detail"][0]["field"] == "message"
        assert rows(d.daemon.supervisor.store, "jobs") == []


async def test_idle_processes_retired_and_idle_sandbox_stopped(fx, tmp_path, sandbox_image, docker_client) -> None:
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, resident_idle_s=1.0, idle_stop_s=2.0)
    async with running_daemon(settings) as d:
        chat = Chat(RUNTIME)
        chat.expect_turn("then go idle")
        receipt, _, _ = await d.run(chat.job("then go idle"))
        container = docker_client.containers.get(receipt["sandbox"]["container_id"])
        with anyio.fail_after(30):
            while True:  # the idle loop stops the container, then records it: wait for both
                status = (await d.client.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()
                if status["sandbox"]["state"] == "stopped":
                    break
                await anyio.sleep(0.25)
        container.reload()
        assert container.status == "exited"
        assert status["members"][0]["resident"] is False
        chat.expect_turn("back again")
        mark = high_water(fx)
        receipt, _, _ = await d.run(chat.job("back again"))
        assert (receipt["context_status"], receipt["outcome"]) == ("RESTORED", "succeeded")
        assert_model_saw(fx, mark, chat)


async def test_client_disconnect_does_not_cancel_the_job(fx, tmp_path, sandbox_image) -> None:
    async with running_daemon(daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)) as d:
        chat = Chat(RUNTIME)
        fx.add_rule(stall(2, match="slow one"))
        reply = chat.expect_turn("slow one")
        job = chat.job("slow one")
        async with httpx.AsyncClient(base_url=d.url, headers={"authorization": f"Bearer {TOKEN}"},
                                     timeout=60) as client:
            async with client.stream("POST", "/v1/jobs", json=job) as resp:
                async for line in resp.aiter_lines():
                    assert json.loads(line) == {"type": "status", "context_status": "NEW"}
                    break  # the client goes away mid-turn
        url = f"/v1/jobs/{job['job_id']}"
        running = await d.client.get(url, params={"user_id": chat.user_id})
        assert (running.status_code, running.json()) == (202, {"job_id": job["job_id"], "status": "running"})
        with anyio.fail_after(60):
            while (got := await d.client.get(url, params={"user_id": chat.user_id})).status_code == 202:
                await anyio.sleep(0.2)
        receipt = got.json()
        assert (receipt["outcome"], receipt["assistant_text"]) == ("succeeded", reply)
