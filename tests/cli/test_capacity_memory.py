"""The resident memory budget through the real daemon, engine and codex CLI: a new resident
that would not fit retires the least recently used idle one — never one in a turn, even
when that one is the least recently used — and the retired member's next turn is RESTORED."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.loopback import LoopbackFixture, assert_history, stall
from tests.daemon_harness import RunningDaemon, daemon_settings, running_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

MiB = 1024 * 1024
# An idle codex resident's tree is ~145 MiB RSS (protocols/baselines.md); a launch counts
# the 160 MiB floor estimate until its first reading. One resident and a launch fit in
# 400 MiB, two and a launch do not.
BUDGET_MB = 400


def samples(text: str) -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def resident(d: RunningDaemon, chat: Chat) -> bool:
    status = (await d.client.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()
    return status["members"][0]["resident"]


async def turn(d: RunningDaemon, fx: LoopbackFixture, chat: Chat, message: str, status: str) -> dict[str, Any]:
    reply = chat.expect_turn(message)
    receipt, _, _ = await d.run(chat.job(message))
    assert (receipt["context_status"], receipt["outcome"], receipt["assistant_text"]) == (status, "succeeded", reply)
    # turns of other chats run meanwhile: find this turn's request by its own last user message
    mine = [r for r in fx.requests(kind="conversation")
            if [m.text for m in r.conversation() if m.role == "user"][-1:] == [message]]
    assert len(mine) == 1
    assert_history(chat.expected_request(), mine[0].conversation())
    return receipt


async def test_the_budget_retires_the_lru_idle_resident_never_one_in_a_turn(tmp_path, sandbox_image) -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rules(stall(20, match="a2 is a long turn"))  # outlasts b1 and c1 (c1 waits out b's 2 s grace)
        settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, resident_memory_mb=BUDGET_MB,
                                   memory_refresh_s=0.5)
        async with running_daemon(settings) as d:
            a, b, c, e = (Chat("codex") for _ in range(4))
            await turn(d, fx, a, "a1", "NEW")
            long_turn: dict[str, Any] = {}

            async def a2() -> None:
                long_turn["receipt"] = await turn(d, fx, a, "a2 is a long turn", "LIVE")

            async with anyio.create_task_group() as tg:
                tg.start_soon(a2)
                with anyio.fail_after(60):
                    while not [r for r in fx.requests(kind="conversation")
                               if "a2 is a long turn" in str(r.body)]:
                        await anyio.sleep(0.1)
                await turn(d, fx, b, "b1", "NEW")  # a (in its turn) is now the least recently used
                await turn(d, fx, c, "c1", "NEW")  # no room for a third: b goes, a stays
                assert "receipt" not in long_turn  # a's turn was in flight all along
                assert (await resident(d, a), await resident(d, b), await resident(d, c)) == (True, False, True)
            assert long_turn["receipt"]["context_status"] == "LIVE"
            # both idle now; c was used before a's long turn ended: c is the one to go
            await turn(d, fx, e, "e1", "NEW")
            assert (await resident(d, a), await resident(d, c), await resident(d, e)) == (True, False, True)
            await turn(d, fx, b, "b2", "RESTORED")  # retired for the budget: resumed, history intact
            assert (await resident(d, a), await resident(d, e), await resident(d, b)) == (False, True, True)
            metrics = samples((await d.client.get("/metrics")).text)
            assert metrics["cloud_agent_resident_memory_budget_bytes"] == BUDGET_MB * MiB
            assert metrics["cloud_agent_resident_memory_retirements_total{cause=launch}"] == 3  # b for c, c for e, a for b
            assert 0 < metrics["cloud_agent_resident_memory_used_bytes"] <= BUDGET_MB * MiB
