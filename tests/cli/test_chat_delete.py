"""Deleting a chat (SPEC 10, issue 19) through the daemon's API, with every pinned CLI in one
chat: the engine, the store and the host's process table keep nothing of it but tombstone
receipts; the same chat id afterwards is a new chat, as the loopback fixture's audit sees."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import docker
import pytest

from deploy.loopback import LoopbackFixture, stall
from sandbox_manager.identity import LABEL_IDENTITY, container_name
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import Chat, assert_model_saw, available_runtimes, high_water
from tests.support.store import rows

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

CHAT_TABLES = ("sandboxes", "members", "wire_records", "wire_turns", "placements")


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def chat_rows(store, user_id: str, chat_id: str) -> dict[str, int]:
    return {t: sum(1 for r in rows(store, t) if (r["user_id"], r["chat_id"]) == (user_id, chat_id))
            for t in CHAT_TABLES}


def host_pids(docker_client, container_id: str) -> list[int]:
    """The host pids of every process in a container (the engine's own view)."""
    top = docker_client.api.top(container_id, ps_args="-eo pid")
    return [int(row[0]) for row in top["Processes"]]


def alive_in(pid: int, container_id: str) -> bool:
    """``pid`` still runs on the host inside that container's cgroup (a reused pid is not it)."""
    try:
        return container_id in Path(f"/proc/{pid}/cgroup").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False


def volumes_of(docker_client, identity: str, name: str) -> list[str]:
    return [v.name for v in docker_client.volumes.list()
            if (v.attrs.get("Labels") or {}).get(LABEL_IDENTITY) == identity or name in v.name]


async def test_delete_destroys_the_chat_and_a_reused_id_is_new(fx, tmp_path, sandbox_image, docker_client) -> None:
    runtimes = available_runtimes()
    chats = {r: Chat(r, member_id=f"m-{r}") for r in runtimes}
    first = chats[runtimes[0]]
    for c in chats.values():  # one chat, one member per CLI
        c.user_id, c.chat_id = first.user_id, first.chat_id
    user, chat_id = first.user_id, first.chat_id
    neighbour = Chat(runtimes[0], chat_id=chat_id)  # another user, the same chat id
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, wire_capture=True)
    async with running_daemon(settings) as d:
        store = d.daemon.supervisor.store
        replies: list[str] = []
        for n, c in enumerate(chats.values()):
            for i, expected in enumerate(("NEW", "LIVE")):
                reply = c.expect_turn(f"turn {i + 1} for {c.runtime}: remember the word kumquat-{c.runtime}")
                receipt, events, _ = await d.run(c.job(c.history[-2].text))
                assert (receipt["context_status"], receipt["outcome"]) == (expected, "succeeded"), \
                    (receipt["reason"], receipt["settlement"])
                assert receipt["assistant_text"] == reply
                replies.append(reply)
            if n < len(chats) - 2:  # two residents stay (five CLIs at once overrun one sandbox's memory)
                retired = await d.client.post(f"/v1/users/{user}/chats/{chat_id}/members/{c.member_id}/retire")
                assert retired.json() == {"retired": True}
        n_reply = neighbour.expect_turn("the neighbour's own message")
        receipt, _, _ = await d.run(neighbour.job("the neighbour's own message"))
        assert (receipt["context_status"], receipt["assistant_text"]) == ("NEW", n_reply)
        container = (await d.client.get(f"/v1/users/{user}/chats/{chat_id}")).json()["sandbox"]["container_id"]
        identity = docker_client.containers.get(container).labels[LABEL_IDENTITY]
        pids = host_pids(docker_client, container)
        assert len(pids) > 2  # the gate plus the two resident CLIs (and their helpers)
        before = chat_rows(store, user, chat_id)
        assert before["members"] == len(runtimes) and before["sandboxes"] == 1 and before["wire_records"] > 0
        # what the daemon keeps in memory of the chat: each member's last wire baseline parsed
        # for its next verdict, the count of its sandbox record's writes, its model socket's
        # members, its two residents
        sup = d.daemon.supervisor
        baselines, model_path, chat_key = sup.model_path.baselines, sup.model_path, \
            sup.model_path.chat_key(user, chat_id)
        assert sorted(m for m in baselines.members() if m[:2] == (user, chat_id)) == sorted(
            (user, chat_id, c.member_id) for c in chats.values())
        assert len(store.sandbox_writes) == 2  # this chat's and the neighbour's
        assert chat_key in model_path.chats
        assert sorted(v for k, v in model_path.members.items() if k[0] == chat_key) == sorted(
            c.member_id for c in chats.values())
        assert len([k for k in sup.pool.keys() if k[:2] == (user, chat_id)]) == 2
        assert any(r["capture_json"] for r in rows(store, "wire_records") if r["user_id"] == user)
        neighbour_rows = chat_rows(store, neighbour.user_id, chat_id)

        # another user cannot delete it, nor learn that it exists
        stranger = await d.client.delete(f"/v1/users/user-stranger/chats/{chat_id}")
        assert (stranger.status_code, stranger.json()) == (404, {"error": "not_found"})
        assert chat_rows(store, user, chat_id) == before
        assert docker_client.containers.get(container).status == "running"

        resp = await d.client.delete(f"/v1/users/{user}/chats/{chat_id}")
        assert resp.status_code == 200, resp.text
        body = resp.json()
        assert body == {"user_id": user, "chat_id": chat_id, "deleted": True, "cancelled_jobs": 0,
                        "retired_residents": 2, "container_removed": True, "volume_removed": True,
                        "records_removed": body["records_removed"], "tombstoned_receipts": 2 * len(runtimes)}
        assert body["records_removed"] == sum(before.values())

        # the engine: no container by id or name, no volume of its identity, no process left
        for ref in (container, container_name(user, chat_id)):
            with pytest.raises(docker.errors.NotFound):
                docker_client.containers.get(ref)
        assert volumes_of(docker_client, identity, container_name(user, chat_id)) == []
        assert [p for p in pids if alive_in(p, container)] == []
        assert not Path(settings.check_socket_root(), container_name(user, chat_id)).exists()
        # the daemon's memory keeps nothing of the chat (the neighbour's stays)
        assert baselines.members() == [(neighbour.user_id, chat_id, neighbour.member_id)]
        assert len(store.sandbox_writes) == 1
        assert chat_key not in model_path.chats
        assert [k for k in (*model_path.members, *model_path.jobs) if k[0] == chat_key] == []
        assert [k for k in sup.pool.keys() if k[:2] == (user, chat_id)] == []
        assert sup.locks.chat_keys(user, chat_id) == []
        # the store: no record, ledger row or captured text; receipts are tombstones without text
        assert chat_rows(store, user, chat_id) == dict.fromkeys(CHAT_TABLES, 0)
        jobs = [r for r in rows(store, "jobs") if (r["user_id"], r["chat_id"]) == (user, chat_id)]
        assert len(jobs) == 2 * len(runtimes) and all(r["deleted_at"] for r in jobs)
        everything = json.dumps([rows(store, t) for t in ("jobs", *CHAT_TABLES)], default=str)
        for reply in replies:
            assert reply not in everything
        assert "kumquat" not in everything  # no user text either (captured texts, failed queries)
        for r in jobs:
            tomb = json.loads(r["receipt_json"])
            assert (tomb["assistant_text"], tomb["locator_after"], tomb["settlement"]["raw"]) == ("", None, [])
            assert tomb["outcome"] == "succeeded" and tomb["context_status"] in ("NEW", "LIVE")
            assert tomb["timings_ms"]["total"] > 0 and tomb["deleted_at"]
        # the job fence still answers for an old job id, with its tombstone
        old = await d.client.get(f"/v1/jobs/{jobs[0]['job_id']}", params={"user_id": user})
        assert old.status_code == 200 and old.json()["assistant_text"] == "" and old.json()["deleted_at"]
        # the neighbour (same chat id, another user) is untouched
        assert chat_rows(store, neighbour.user_id, chat_id) == neighbour_rows
        assert (await d.client.get(f"/v1/users/{neighbour.user_id}/chats/{chat_id}")).json()["sandbox"]["state"] \
            == "running"

        # deleting again is fine and removes nothing
        again = await d.client.delete(f"/v1/users/{user}/chats/{chat_id}")
        assert again.status_code == 200
        assert {k: again.json()[k] for k in ("retired_residents", "container_removed", "records_removed",
                                             "tombstoned_receipts")} == {
            "retired_residents": 0, "container_removed": False, "records_removed": 0, "tombstoned_receipts": 0}
        status = (await d.client.get(f"/v1/users/{user}/chats/{chat_id}")).json()
        assert status == {"error": "not_found"}

        # the same chat id is a new chat for every CLI: NEW, and the model sees only the new message
        for c in chats.values():
            fresh = Chat(c.runtime, user_id=user, chat_id=chat_id, member_id=c.member_id)
            message = f"a fresh start for {c.runtime}: what word did I ask you to remember?"
            reply = fresh.expect_turn(message)
            mark = high_water(fx)
            receipt, events, _ = await d.run(fresh.job(message))
            assert (receipt["context_status"], receipt["outcome"], receipt["locator_before"]) == (
                "NEW", "succeeded", None), events
            assert receipt["assistant_text"] == reply and receipt["wire"]["history"] == "new"
            assert_model_saw(fx, mark, fresh)  # exactly [] before this message: nothing of the old chat
            assert receipt["sandbox"]["container_id"] != container
            retired = await d.client.post(f"/v1/users/{user}/chats/{chat_id}/members/{c.member_id}/retire")
            assert retired.json() == {"retired": True}
        status = (await d.client.get(f"/v1/users/{user}/chats/{chat_id}")).json()
        assert [m["settled_turns"] for m in status["members"]] == [1] * len(runtimes)
        assert len(status["last_receipts"]) == len(runtimes)
        assert all(r["assistant_text"] for r in status["last_receipts"])


async def test_delete_cancels_a_running_turn_first(fx, tmp_path, sandbox_image, docker_client) -> None:
    runtime = "codex" if "codex" in available_runtimes() else available_runtimes()[0]
    chat = Chat(runtime)
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)
    async with running_daemon(settings) as d:
        chat.expect_turn("a first turn")
        receipt, _, _ = await d.run(chat.job("a first turn"))
        assert receipt["outcome"] == "succeeded"
        container = receipt["sandbox"]["container_id"]
        fx.add_rule(stall(30, match="a very slow turn"))
        job = chat.job("a very slow turn")
        mark = high_water(fx)
        result: dict = {}

        async def run_slow() -> None:
            result["receipt"], result["events"], _ = await d.run(job)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run_slow)
            with anyio.fail_after(60):  # the CLI's request is at the model: the turn is running
                while not [r for r in fx.requests() if r.seq > mark and r.kind == "conversation"]:
                    await anyio.sleep(0.1)
            pids = host_pids(docker_client, container)
            resp = await d.client.delete(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")
        assert resp.status_code == 200 and resp.json()["cancelled_jobs"] == 1, resp.text
        slow = result["receipt"]
        assert (slow["job_id"], slow["outcome"], slow["reason"]) == (job["job_id"], "not_settled", "chat_deleted")
        assert [p for p in pids if alive_in(p, container)] == []
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(container)
        tomb = (await d.client.get(f"/v1/jobs/{job['job_id']}", params={"user_id": chat.user_id})).json()
        assert (tomb["outcome"], tomb["reason"], tomb["assistant_text"]) == ("not_settled", "chat_deleted", "")
        # a re-dispatch of the cancelled job never runs it: the fence answers with the tombstone
        again, _, resp = await d.run(job)
        assert resp.headers.get("x-job-replayed") == "true" and again["reason"] == "chat_deleted"
