"""The supervisor's per-key state does not grow with the number of chats it has served.

A fake engine refuses the image, so every job runs the real job fence, member lock, turn
state machine and commit, and is refused before any container would be made.
"""

from __future__ import annotations

import anyio
import pytest

from runner.config import load_settings
from tests import daemon_harness  # by module: a test_* name imported here would be collected
from state.jobs import Job
from runner.supervisor import build_supervisor
from tests.support.fake_engine import RefusingEngine

pytestmark = pytest.mark.anyio


async def test_locks_jobs_and_streams_are_pruned_after_many_chats(tmp_path) -> None:
    settings = load_settings({"CLOUD_AGENT_HOME": str(tmp_path), "CLOUD_AGENT_SOCKET_DIR": daemon_harness.test_socket_dir(tmp_path),
                              "CLOUD_AGENT_IMAGE": "fake:1",
                              "CLOUD_AGENT_GATEWAY_URL": "http://127.0.0.1:9", "CLOUD_AGENT_MAX_TURNS": "4",
                              "CLOUD_AGENT_PROXY_PROCESS": "daemon"})  # no model request is ever made
    sup = build_supervisor(settings, "http://127.0.0.1:9", engine=RefusingEngine())  # type: ignore[arg-type]
    outcomes: list[tuple[str, str | None]] = []
    queued = 0

    async def one(i: int) -> None:
        job = Job(job_id=f"j{i}", user_id=f"u{i % 7}", chat_id=f"c{i}", member_id=f"m{i % 3}", runtime="codex",
                  message="hi")
        receipt, events, kind = await sup.run_job(job)
        nonlocal queued
        assert kind == "started" and receipt is not None and events[-1]["type"] == "receipt"
        queued += any(e["type"] == "queued" for e in events)
        outcomes.append((receipt.outcome.value, receipt.reason))

    async with sup.running():
        for start in range(0, 600, 50):
            async with anyio.create_task_group() as tg:
                for i in range(start, start + 50):
                    tg.start_soon(one, i)
        assert outcomes == [("refused", "image_unsupported")] * 600
        assert queued > 0  # 50 at once, 4 turn slots: the queue was used
        assert (len(sup.locks), len(sup._jobs), len(sup.pool)) == (0, 0, 0)
        adm = sup.capacity.admission
        assert (adm.running, adm.depth, adm.queue.users(), dict(sup.capacity.room.admitted)) == (0, 0, 0, {})
