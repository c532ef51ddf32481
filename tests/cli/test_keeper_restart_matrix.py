"""SPEC 14 under repetition (issue 14): three ``kill -9`` restarts of the daemon in a row, each
with four turns in flight; every turn is committed exactly once by the next daemon, the next
turn of every chat is LIVE, and no user message reaches the model twice or is missing from any
history (tests/support/restarts.py). The bench runs the same routine with longer holds and
timings: tests/bench/bench_keeper_restart.py."""

from __future__ import annotations

import pytest

from deploy.loopback import LoopbackFixture
from tests.support.restarts import run_restart_rounds

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


async def test_three_kill_9_restarts_under_four_turns_in_flight(tmp_path, sandbox_image) -> None:
    with LoopbackFixture.start() as fx:
        report = await run_restart_rounds(fx, tmp_path / "home", sandbox_image, "codex", n_chats=4, restarts=3)
    assert report.problems == []
    assert (report.held, report.committed_once) == (12, 12)
