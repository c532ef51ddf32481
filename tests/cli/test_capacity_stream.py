"""A job whose reader is absent: the daemon keeps at most the stream budget, the turn still
settles and commits, and the stream ends with a cut line, then the receipt (real codex)."""

from __future__ import annotations

import json

import anyio
import pytest

from deploy.loopback import LoopbackFixture, reply
from state.jobs import Job
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

BUDGET = 300


async def test_an_absent_reader_gets_a_cut_stream_and_the_turn_commits(tmp_path, sandbox_image) -> None:
    long = "".join(f"line {i:04d} of a long answer. " for i in range(400))  # 4 deltas of ~3 KB
    with LoopbackFixture.start() as fx:
        fx.add_rules(reply(long, match="write a lot"))
        settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, event_buffer_bytes=BUDGET)
        async with running_daemon(settings) as d:
            chat = Chat("codex")
            job = chat.job("write a lot")
            sub = await d.daemon.supervisor.submit(Job.model_validate(job))
            assert sub.kind == "started" and sub.events is not None
            with anyio.fail_after(180):  # nobody reads the stream meanwhile
                while True:
                    # Read before asking: a 202 says the turn had not committed when the request
                    # read the store, so the stream had not ended (its cut line and receipt go
                    # beyond the budget) when this was read. Read after the 202, the turn may
                    # have ended meanwhile: the response waits for the store's flush.
                    buffered = sub.events.buffered_bytes
                    resp = await d.client.get(f"/v1/jobs/{job['job_id']}", params={"user_id": chat.user_id})
                    if resp.status_code != 202:
                        break
                    assert buffered <= BUDGET
                    await anyio.sleep(0.2)
            stored = resp.json()
            assert (stored["outcome"], stored["assistant_text"]) == ("succeeded", long)
            lines = [json.loads(line) async for line in sub.events.lines()]
            assert lines[0] == {"type": "status", "context_status": "NEW"}
            cut, last = lines[-2], lines[-1]
            assert cut["type"] == "cut" and cut["reason"] == "slow_reader" and cut["budget_bytes"] == BUDGET
            assert cut["dropped"] >= 4  # every text delta of the long answer
            assert all(e["type"] == "event" for e in lines[1:-2])
            assert last == {"type": "receipt", "receipt": stored}
            assert sub.events.buffered_bytes == 0
