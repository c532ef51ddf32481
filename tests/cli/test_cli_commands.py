"""`cloud-agent` as a client of a real daemon: output and exit codes per outcome."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest

from deploy.loopback import LoopbackFixture, reject, stall
from tests.daemon_harness import TOKEN, daemon_process

pytestmark = [pytest.mark.cli, pytest.mark.docker]


def cli(url: str, token_file: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CLOUD_AGENT_URL=url, CLOUD_AGENT_SERVICE_TOKEN_FILE=token_file)
    return subprocess.run([sys.executable, "-m", "runner.cli", *args], capture_output=True, text=True, env=env,
                          timeout=300)


def test_exit_codes_and_json(tmp_path, sandbox_image) -> None:
    home = tmp_path / "home"
    with LoopbackFixture.start() as fx, daemon_process(home, fx.base_url, sandbox_image) as dp:
        token = str(home / "token")
        fx.add_rule(reject(match="please fail"))
        base = ["run", "--user", "u1", "--chat", "c1", "--member", "m1", "--runtime", "codex"]
        ok = cli(dp.url, token, *base, "hello")
        assert ok.returncode == 0, ok.stderr
        assert ok.stdout.startswith("ok 1: ")
        assert "context     NEW" in ok.stderr and "outcome     succeeded" in ok.stderr
        failed = cli(dp.url, token, *base, "please fail", "--json")
        assert failed.returncode == 2, failed.stderr
        receipt = json.loads(failed.stdout.strip().splitlines()[-1])["receipt"]
        assert (receipt["context_status"], receipt["outcome"], receipt["reason"]) == ("LIVE", "failed", "api_error")
        refused = cli(dp.url, token, *base, "--locator", "01a20000-0000-7000-8000-000000000000", "x")
        assert refused.returncode == 3 and "reason      locator_mismatch" in refused.stderr
        status = json.loads(cli(dp.url, token, "status", "u1", "c1").stdout)
        assert [(m["member_id"], m["settled_turns"], m["resident"]) for m in status["members"]] == [("m1", 2, True)]
        assert json.loads(cli(dp.url, token, "retire", "u1", "c1", "m1").stdout) == {"retired": True}
        forked = json.loads(cli(dp.url, token, "fork", "u1", "c1", "m1", "--new-member", "m2", "--at-turn", "1").stdout)
        assert (forked["member_id"], forked["forked_from"], forked["at_turn"]) == ("m2", "m1", 1)
        assert json.loads(cli(dp.url, token, "stop", "u1", "c1").stdout) == {"stopped": True}
        missing = cli(dp.url, token, "status", "u1", "nope")
        assert missing.returncode == 1 and "HTTP 404" in missing.stderr
        deleted = json.loads(cli(dp.url, token, "delete", "u1", "c1").stdout)
        assert (deleted["deleted"], deleted["container_removed"], deleted["tombstoned_receipts"]) == (True, True, 3)
        again = cli(dp.url, token, "delete", "u1", "c1")
        assert again.returncode == 0 and json.loads(again.stdout)["container_removed"] is False
        gone = cli(dp.url, token, "delete", "u2", "c1", "--json")
        assert gone.returncode == 1 and json.loads(gone.stderr) == {"status": 404, "error": {"error": "not_found"}}
        after = cli(dp.url, token, "status", "u1", "c1")
        assert after.returncode == 1 and "HTTP 404" in after.stderr
        bad = tmp_path / "bad-token"
        bad.write_text("x" * len(TOKEN))
        denied = cli(dp.url, str(bad), "attest")
        assert denied.returncode == 1 and "HTTP 401" in denied.stderr
        attest = json.loads(cli(dp.url, token, "attest").stdout)
        assert attest["required_helper"] == {"name": "http-agent-live-bridge", "version": 4}


def test_a_turn_that_does_not_settle_exits_4(tmp_path, sandbox_image) -> None:
    """The turn is held in the fixture past the daemon's turn timeout: not_settled, exit code 4."""
    home = tmp_path / "home"
    with LoopbackFixture.start() as fx, daemon_process(home, fx.base_url, sandbox_image,
                                                       env={"CLOUD_AGENT_TURN_TIMEOUT_S": "3"}) as dp:
        token = str(home / "token")
        # container names derive from (user, chat): ids of its own, not another test's sandbox
        base = ["run", "--user", f"u-{uuid.uuid4().hex[:8]}", "--chat", "c1", "--member", "m1", "--runtime", "codex"]
        first = cli(dp.url, token, *base, "hello")
        assert first.returncode == 0, first.stderr
        fx.add_rule(stall(600, match="please hang", id="hang"))
        try:
            hung = cli(dp.url, token, *base, "please hang")
            as_json = cli(dp.url, token, *base, "--json", "please hang again")
        finally:
            fx.release_stalls()
        assert hung.returncode == 4, hung.stderr
        lines = [line.strip() for line in hung.stderr.splitlines()]
        for line in ("context     LIVE", "outcome     not_settled", "reason      timeout"):
            assert line in lines, hung.stderr
        assert as_json.returncode == 4, as_json.stderr
        receipt = json.loads(as_json.stdout.strip().splitlines()[-1])["receipt"]
        assert (receipt["context_status"], receipt["outcome"], receipt["reason"]) == ("RESTORED", "not_settled",
                                                                                     "timeout")
        assert [r.rule for r in fx.requests(kind="conversation")] == [None, "hang", "hang"]
