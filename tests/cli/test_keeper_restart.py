"""SPEC 14 through the full stack (daemon subprocess, real engine, real pinned CLIs, the fixture):
resident CLIs and turns in flight survive a daemon restart through their in-sandbox keepers."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from deploy.loopback import LoopbackFixture, reply, stall
from sandbox_manager.identity import member_key
from sandbox_manager.keeper_sandbox import KeeperPaths, status_argv
from tests.daemon_harness import TOKEN, DaemonProcess, daemon_process, daemon_settings, running_daemon
from tests.supervisor_helpers import Chat, assert_model_saw, high_water, runtimes_one_per_bridge

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]
HEADERS = {"authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def keeper_row(home: Path, chat: Chat) -> dict[str, Any] | None:
    db = sqlite3.connect(home / "store.db")
    try:
        row = db.execute("SELECT record_json FROM keepers WHERE user_id=? AND chat_id=? AND member_id=?",
                         (chat.user_id, chat.chat_id, chat.member_id)).fetchone()
    finally:
        db.close()
    return None if row is None else json.loads(row[0])


def keeper_status(docker_client, rec: dict[str, Any]) -> dict[str, Any]:
    """``ca-keeper status`` in the sandbox: the keeper's hello, its turn note included."""
    argv = status_argv(KeeperPaths.in_run_dir(rec["run_dir"]))
    out = docker_client.containers.get(rec["container_id"]).exec_run(argv, user="agent").output
    return json.loads(out)


def cli_alive(docker_client, cid: str, pid: int) -> bool:
    out = docker_client.containers.get(cid).exec_run(["ps", "-o", "stat=", "-p", str(pid)]).output.decode().strip()
    return bool(out) and not out.startswith("Z")


async def only_the_keeper(docker_client, cid: str) -> list[str]:
    """The sandbox's ca-keeper processes once the daemon's link settles: the keeper alone. The
    daemon links to its socket from the host (sandbox_manager.keeper_link), so neither the
    start's exec (``ca-keeper run``, its relay) nor a re-attach's (``ca-keeper attach``) stays."""
    with anyio.fail_after(10):
        while True:
            ps = docker_client.containers.get(cid).exec_run(["ps", "-eo", "stat=,args="]).output.decode()
            rows = [line.split(None, 1)[1] for line in ps.splitlines()
                    if "/ca-keeper " in line and not line.split()[0].startswith("Z")]
            if len(rows) == 1:
                return rows
            await anyio.sleep(0.2)


async def turn(client: httpx.AsyncClient, fx, chat: Chat, message: str) -> dict[str, Any]:
    expected = chat.expect_turn(message)
    mark = high_water(fx)
    resp = await client.post("/v1/jobs", json=chat.job(message))
    assert resp.status_code == 200, resp.text
    receipt = json.loads(resp.text.strip().splitlines()[-1])["receipt"]
    assert receipt["outcome"] == "succeeded", receipt
    assert receipt["assistant_text"] == expected
    assert_model_saw(fx, mark, chat)
    return receipt


@pytest.mark.parametrize("runtime", runtimes_one_per_bridge())
async def test_resident_is_live_after_sigterm_and_after_kill_9(runtime, fx, tmp_path, sandbox_image,
                                                              docker_client) -> None:
    home, chat = tmp_path / "home", Chat(runtime)
    with daemon_process(home, fx.base_url, sandbox_image) as dp:
        async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=180) as client:
            first = await turn(client, fx, chat, f"first turn of {runtime}")
            assert first["context_status"] == "NEW"
        ident = keeper_row(home, chat)["identity"]
        cid = first["sandbox"]["container_id"]
        assert cli_alive(docker_client, cid, ident["pid"])
        assert " run " in (await only_the_keeper(docker_client, cid))[0]
        dp.terminate()  # SIGTERM: a graceful shutdown leaves the resident running
    assert cli_alive(docker_client, cid, ident["pid"])
    for i, stop in enumerate(("kill -9", "end")):
        with daemon_process(home, fx.base_url, sandbox_image) as dp:
            async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=180) as client:
                receipt = await turn(client, fx, chat, f"turn {i + 2} of {runtime} after a restart")
                assert receipt["context_status"] == "LIVE", receipt
                assert receipt["locator_before"] == first["locator_after"] == receipt["locator_after"]
                assert receipt["sandbox"]["container_id"] == cid
                assert " run " in (await only_the_keeper(docker_client, cid))[0]  # re-attached with no exec
            assert keeper_row(home, chat)["identity"] == ident  # the very same native process
            if stop == "kill -9":
                dp.kill9()
    assert cli_alive(docker_client, cid, ident["pid"])


# From inside a sandbox, as its CLI would: a side request through the model socket, on a member's
# base URL (its path prefix attributes it to the member's running turn)
SIDE_REQUEST = ("import http.client, sys; c = http.client.HTTPConnection('127.0.0.1', 18080, timeout=30); "
                "c.request('GET', '/m/' + sys.argv[1] + '/v1/models'); print(c.getresponse().status)")


def ledger_of(home: Path, job_id: str) -> list[tuple[str, str]]:
    db = sqlite3.connect(home / "store.db")
    try:
        rows = db.execute("SELECT record_json FROM wire_records WHERE job_id=? ORDER BY ordinal", (job_id,)).fetchall()
    finally:
        db.close()
    return [(json.loads(r[0])["method"], json.loads(r[0])["path"]) for r in rows]


async def stop_while_the_reply_streams(fx, home: Path, image: str, docker_client,
                                       stop: Callable[[DaemonProcess], None], hold_s: float) -> None:
    """``stop`` the daemon while the model's reply to a turn streams (the fixture holds it for
    ``hold_s``: long enough for the stop and the next daemon's start). While no daemon is
    attached, the sandbox sends one more request of the turn. The next daemon commits the turn
    once, with the reply; exactly one request carried the message, and both are the turn's."""
    chat = Chat("codex")
    with daemon_process(home, fx.base_url, image) as dp:
        async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=180) as client:
            first = await turn(client, fx, chat, "before the crash")
            expected = chat.expect_turn("during the crash")
            fx.add_rule(stall(hold_s, match="during the crash", times=1))
            crash_job = chat.job("during the crash")

            async def doomed() -> None:
                try:
                    await client.post("/v1/jobs", json=crash_job)
                except httpx.HTTPError:
                    pass

            async with anyio.create_task_group() as tg:
                tg.start_soon(doomed)
                # the reply is streaming: headers and its first event are out, the rest held
                await anyio.to_thread.run_sync(lambda: fx.wait_for(
                    lambda rs: any("during the crash" in json.dumps(r.body) for r in rs), timeout=90))
                await anyio.sleep(1.0)
                # the turn in flight is the keeper's note (runner.keepers), not a store write
                rec = keeper_row(home, chat)
                assert rec["turn"] is None
                note = json.loads(keeper_status(docker_client, rec)["hello"]["turn_note"])
                assert json.loads(note["turn"]["job_json"])["job_id"] == crash_job["job_id"]
                await anyio.to_thread.run_sync(stop, dp)
                tg.cancel_scope.cancel()
    # no daemon now: the proxy service still serves the sandbox and knows the member's turn
    container = docker_client.containers.get(first["sandbox"]["container_id"])
    side = await anyio.to_thread.run_sync(lambda: container.exec_run(
        ["python3", "-c", SIDE_REQUEST, member_key(chat.member_id)], user="agent"))
    assert side.exit_code == 0, side.output
    with daemon_process(home, fx.base_url, image) as dp:
        async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=180) as client:
            url, params = f"/v1/jobs/{crash_job['job_id']}", {"user_id": chat.user_id}
            answers = []
            with anyio.fail_after(120):
                while True:
                    resp = await client.get(url, params=params)
                    answers.append(resp.status_code)
                    if resp.status_code != 202:
                        break
                    assert resp.json() == {"job_id": crash_job["job_id"], "status": "running"}
                    await anyio.sleep(0.2)
            # the model proxy's service outlived the daemon: the held reply reached the CLI whole,
            # and the message reached the model in exactly one request (no retry after a broken stream)
            carried = [r for r in fx.requests(kind="conversation")
                       if [m.text for m in r.conversation() if m.role == "user"][-1:] == ["during the crash"]]
            assert len(carried) == 1, [r.seq for r in carried]
            assert answers[-1] == 200 and answers[0] == 202 and set(answers[:-1]) == {202}
            got = resp.json()
            assert (got["outcome"], got["context_status"], got["assistant_text"]) == ("succeeded", "LIVE", expected)
            assert got["locator_before"] == first["locator_after"] == got["locator_after"]
            assert got["sandbox"]["container_id"] == first["sandbox"]["container_id"]
            assert got["sandbox"]["image_id"] and got["cli_version"] and got["settlement"]["evidence"]
            # the proxy's own witness: the held request and the one sent while no daemon was
            # attached are both recorded against this turn
            assert ledger_of(home, crash_job["job_id"]) == [("POST", "/v1/responses"), ("GET", "/v1/models")]
            wire = got["wire"]
            assert (wire["history"], wire["requests"], wire["side_requests"]) == ("complete", 2, 1), wire
            # a re-dispatch returns the one receipt; nothing runs again
            mark = high_water(fx)
            again = await client.post("/v1/jobs", json=crash_job)
            assert json.loads(again.text.strip().splitlines()[-1])["receipt"] == got
            assert [r for r in fx.requests() if r.seq > mark] == []
            nxt = await turn(client, fx, chat, "after the crash")
            assert nxt["context_status"] == "LIVE"
    jobs = sqlite3.connect(home / "store.db").execute("SELECT state FROM jobs WHERE job_id=?",
                                                      (crash_job["job_id"],)).fetchall()
    assert jobs == [("done",)]


async def test_kill_9_while_the_reply_streams_commits_the_turn_once(fx, tmp_path, sandbox_image,
                                                                    docker_client) -> None:
    await stop_while_the_reply_streams(fx, tmp_path / "home", sandbox_image, docker_client, DaemonProcess.kill9,
                                       hold_s=12)


async def test_sigterm_while_the_reply_streams_commits_the_turn_once(fx, tmp_path, sandbox_image,
                                                                     docker_client) -> None:
    """A graceful stop leaves the turn to the next daemon (the proxy service keeps it as the
    member's running turn). The daemon's own shutdown waits up to 10 s for open HTTP answers."""
    await stop_while_the_reply_streams(fx, tmp_path / "home", sandbox_image, docker_client,
                                       DaemonProcess.terminate, hold_s=22)


async def test_a_forged_keeper_identity_is_refused(fx, tmp_path, sandbox_image, docker_client) -> None:
    home, chat = tmp_path / "home", Chat("codex")
    async with running_daemon(daemon_settings(home, fx.base_url, sandbox_image)) as d:
        first = await turn(d.client, fx, chat, "before the forgery")
    rec = keeper_row(home, chat)
    real_pid, cid = rec["identity"]["pid"], first["sandbox"]["container_id"]
    assert cli_alive(docker_client, cid, real_pid)
    # the recorded identity no longer matches what answers on the keeper's socket
    rec["identity"]["keeper_id"] = "f" * 32
    db = sqlite3.connect(home / "store.db")
    db.execute("UPDATE keepers SET record_json=? WHERE member_id=?", (json.dumps(rec), chat.member_id))
    db.commit()
    db.close()
    async with running_daemon(daemon_settings(home, fx.base_url, sandbox_image)) as d:
        assert not d.daemon.supervisor.pool.is_resident((chat.user_id, chat.chat_id, chat.member_id))
        assert not cli_alive(docker_client, cid, real_pid)  # never trusted: ended, not adopted
        receipt = await turn(d.client, fx, chat, "after the forgery")
        assert receipt["context_status"] == "RESTORED"
        assert receipt["locator_before"] == first["locator_after"] == receipt["locator_after"]
    assert keeper_row(home, chat)["identity"]["pid"] != real_pid


async def test_keeper_buffer_overflow_retires_the_member(fx, tmp_path, sandbox_image, docker_client) -> None:
    home, chat = tmp_path / "home", Chat("codex")
    settings = daemon_settings(home, fx.base_url, sandbox_image, keeper_buffer_bytes=256 * 1024)
    async with running_daemon(settings) as d:
        first = await turn(d.client, fx, chat, "a short one")
        pid = keeper_row(home, chat)["identity"]["pid"]
        fx.add_rule(reply("x" * (1024 * 1024), match="a long one", times=1))
        receipt, _, _ = await d.run(chat.job("a long one"))
        assert (receipt["outcome"], receipt["reason"]) == ("not_settled", "transport_closed"), receipt
        assert "the keeper is broken: more than 262144 bytes of output not acknowledged" in receipt["settlement"]["detail"]
        assert receipt["locator_after"] == first["locator_after"]
        assert keeper_row(home, chat) is None
        assert not cli_alive(docker_client, first["sandbox"]["container_id"], pid)
        receipt, _, _ = await d.run(chat.job("after the overflow"))
        assert (receipt["context_status"], receipt["outcome"]) == ("RESTORED", "succeeded"), receipt
