"""`python -m deploy.reliability … --smoke RUNTIMES` against a real daemon, real CLIs and the
loopback fixture: every runtime's synthetic chat passes NEW → LIVE → stop → RESTORED and is
deleted; a removed sandbox or a changed locator fails the named step; a failed and an
interrupted run leave no chat behind."""

from __future__ import annotations

import json
import signal
import sys
import uuid

import anyio
import pytest

from deploy.loopback import LoopbackFixture, stall
from deploy.smoke import MESSAGES, STEPS, run_smoke
from sandbox_manager.identity import LABEL_HOST
from tests.cli.attestation_helpers import REPO, git_head, wait_ready
from tests.daemon_harness import TOKEN, daemon_settings, running_daemon
from tests.support.store import rows as table_rows
from tests.support.smoke_seams import forge_locator_of, remove_sandbox_after_stop
from tests.supervisor_helpers import available_runtimes

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def settings(tmp_path, fx, image):
    return daemon_settings(tmp_path / "home", fx.base_url, image, host_id=f"smoke-{uuid.uuid4().hex[:10]}")


def rows(lines: list[str]) -> dict[str, tuple[str, str]]:
    out = {}
    for line in lines:
        if line.startswith("smoke."):
            name, result, detail = line.split(None, 2)
            out[name] = (result, detail)
    return out


def assert_no_chat_left(store, docker_client, host_id: str) -> None:
    """Nothing of any smoke chat: no record of it, no container of this host in the engine."""
    for table in ("sandboxes", "members", "wire_records", "wire_turns", "placements"):
        assert [r for r in table_rows(store, table) if r["user_id"].startswith("smoke-")] == [], table
    jobs = [r for r in table_rows(store, "jobs") if r["user_id"].startswith("smoke-")]
    assert jobs and all(r["deleted_at"] and r["state"] == "done" for r in jobs)
    assert all(json.loads(r["receipt_json"])["assistant_text"] == "" for r in jobs)
    assert docker_client.api.containers(all=True, filters={"label": f"{LABEL_HOST}={host_id}"}) == []


async def test_the_smoke_passes_for_every_runtime_and_deletes_its_chats(fx, tmp_path, sandbox_image,
                                                                        docker_client) -> None:
    runtimes = available_runtimes()
    s = settings(tmp_path, fx, sandbox_image)
    async with running_daemon(s) as d:
        await wait_ready(d.client)
        sha = git_head()
        mark = len(fx.requests())
        out = await anyio.run_process([sys.executable, "-m", "deploy.reliability", d.url, "--expect-sha", sha,
                                       "--allow-dirty", "--token-file", str(s.service_token_file),
                                       "--smoke", ",".join(runtimes)], cwd=REPO, check=False)
        lines = out.stdout.decode().splitlines()
        assert (out.returncode, lines[-1]) == (0, "all checks passed"), "\n".join(lines)
        got = rows(lines)
        assert list(got) == [f"smoke.{r}.{step}" for r in runtimes for step in STEPS]
        for r in runtimes:
            assert got[f"smoke.{r}.new"][1].startswith("NEW in ")
            assert ", wire new (" in got[f"smoke.{r}.new"][1]
            for step, status in (("live", "LIVE"), ("restored", "RESTORED")):
                assert got[f"smoke.{r}.{step}"][0] == "pass"
                detail = got[f"smoke.{r}.{step}"][1]
                assert detail.startswith(f"{status} in ") and ", wire complete (" in detail and detail.endswith(" s)")
            # the same container and locator all along (the NEW row names them)
            same = got[f"smoke.{r}.new"][1].split(", wire")[0].removeprefix("NEW in ")
            assert got[f"smoke.{r}.restored"][1].split(", wire")[0].removeprefix("RESTORED in ") == same
            assert got[f"smoke.{r}.stop"][0] == "pass"
            assert got[f"smoke.{r}.delete"][1].startswith("deleted: container removed True, 3 receipts kept")
        seen = len(fx.requests()) - mark
        assert f"smoke cost: {seen} model requests (" in "\n".join(lines) and seen >= 3 * len(runtimes)
        assert_no_chat_left(d.daemon.supervisor.store, docker_client, s.resolved_host_id())


async def test_a_removed_sandbox_or_a_changed_locator_fails_the_named_step(fx, tmp_path, sandbox_image,
                                                                           docker_client) -> None:
    runtime = "codex" if "codex" in available_runtimes() else available_runtimes()[0]
    s = settings(tmp_path, fx, sandbox_image)
    async with running_daemon(s) as d:
        removed = await run_smoke(d.url, TOKEN, [runtime], transport=remove_sandbox_after_stop(docker_client))
        by = {r.name: r for r in removed.rows}
        assert not removed.ok
        assert [(r.name.rsplit(".", 1)[1], r.result) for r in removed.rows] == [
            ("new", "pass"), ("live", "pass"), ("stop", "pass"), ("restored", "fail"), ("delete", "pass")]
        assert by[f"smoke.{runtime}.restored"].detail == "expected RESTORED succeeded, got LOST refused " \
                                                         "(volume_missing)"
        forged = await run_smoke(d.url, TOKEN, [runtime], transport=forge_locator_of("live"))
        assert [(r.name.rsplit(".", 1)[1], r.result) for r in forged.rows] == [
            ("new", "pass"), ("live", "fail"), ("stop", "skip"), ("restored", "skip"), ("delete", "pass")]
        live = forged.rows[1].detail
        assert live.startswith("locator changed: ") and live.endswith(" -> forged-locator")
        assert_no_chat_left(d.daemon.supervisor.store, docker_client, s.resolved_host_id())


async def test_an_interrupted_smoke_deletes_its_chat(fx, tmp_path, sandbox_image, docker_client) -> None:
    runtime = "codex" if "codex" in available_runtimes() else available_runtimes()[0]
    s = settings(tmp_path, fx, sandbox_image)
    async with running_daemon(s) as d:
        await wait_ready(d.client)
        fx.add_rule(stall(60, match=MESSAGES["live"]))
        argv = [sys.executable, "-m", "deploy.reliability", d.url, "--expect-sha", git_head(), "--allow-dirty",
                "--token-file", str(s.service_token_file), "--smoke", runtime]
        async with await anyio.open_process(argv, cwd=REPO) as proc:
            with anyio.fail_after(120):  # the live follow-up is at the model: the smoke is mid-step
                while not [r for r in fx.requests(kind="conversation") if MESSAGES["live"] in str(r.body)]:
                    await anyio.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            with anyio.fail_after(60):
                assert proc.stdout is not None
                stdout = b"".join([chunk async for chunk in proc.stdout]).decode()
                code = await proc.wait()
        lines = stdout.splitlines()
        assert code == 1, lines
        got = rows(lines)
        assert got[f"smoke.{runtime}.new"][0] == "pass"
        assert got[f"smoke.{runtime}.live"][0] == "fail" and got[f"smoke.{runtime}.live"][1].startswith("interrupted")
        assert got[f"smoke.{runtime}.delete"][0] == "pass"
        assert lines[-1].startswith("FAILED: ") and f"smoke.{runtime}.live" in lines[-1]
        assert_no_chat_left(d.daemon.supervisor.store, docker_client, s.resolved_host_id())
        # the daemon cancelled the interrupted turn as the chat was deleted
        live = [r for r in table_rows(d.daemon.supervisor.store, "jobs") if r["job_id"].endswith("-live")]
        assert len(live) == 1 and '"reason":"chat_deleted"' in live[0]["receipt_json"]
