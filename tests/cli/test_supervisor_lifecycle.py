"""Issue 5 acceptance through the full stack: daemon HTTP API -> runner -> retained sandbox
-> real pinned CLI -> loopback fixture."""

from __future__ import annotations

import pytest

from deploy.loopback import LoopbackFixture
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import Chat, assert_model_saw, available_runtimes, high_water
from tests.support.metrics import sample

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


@pytest.mark.parametrize("runtime", available_runtimes())
async def test_new_live_restored_restored_lost(runtime, fx, tmp_path, sandbox_image, docker_client) -> None:
    chat = Chat(runtime)
    async with running_daemon(daemon_settings(tmp_path / "home", fx.base_url, sandbox_image)) as d:
        base = f"/v1/users/{chat.user_id}/chats/{chat.chat_id}"
        steps = [("NEW", None), ("LIVE", None), ("RESTORED", "retire"), ("RESTORED", "stop")]
        locator = None
        for i, (expected, before) in enumerate(steps):
            if before == "retire":
                resp = await d.client.post(f"{base}/members/{chat.member_id}/retire")
                assert resp.json() == {"retired": True}
            elif before == "stop":
                resp = await d.client.post(f"{base}/stop")
                assert resp.json() == {"stopped": True}
                assert docker_client.containers.get(container).status == "exited"
            message = f"turn {i + 1} of {runtime}: say something"
            reply = chat.expect_turn(message)
            mark = high_water(fx)
            receipt, events, resp = await d.run(chat.job(message))
            assert resp.status_code == 200
            assert resp.headers["content-type"].startswith("application/x-ndjson")
            assert receipt is not None, events
            assert (receipt["context_status"], receipt["outcome"]) == (expected, "succeeded"), receipt
            assert receipt["assistant_text"] == reply
            assert events[0] == {"type": "status", "context_status": expected}
            assert events[-1]["type"] == "receipt"
            assert_model_saw(fx, mark, chat)
            if locator is None:
                locator = receipt["locator_after"]
                container = receipt["sandbox"]["container_id"]
            assert receipt["locator_before"] == (None if i == 0 else locator)
            assert receipt["locator_after"] == locator
            assert receipt["sandbox"]["container_id"] == container
            assert receipt["settlement"]["evidence"]
            assert all(v >= 0 for v in receipt["timings_ms"].values())
        status = (await d.client.get(base)).json()
        member = status["members"][0]
        assert (member["runtime"], member["settled_turns"], member["locator"]["id"]) == (runtime, 4, locator)
        # LOST: the container and its state volume are removed; the turn is refused and the
        # model sees nothing
        docker_client.api.remove_container(container, force=True)
        docker_client.api.remove_volume(receipt["sandbox"]["volume"])
        mark = high_water(fx)
        receipt, _, _ = await d.run(chat.job("are you still there?"))
        assert (receipt["context_status"], receipt["outcome"], receipt["reason"]) == ("LOST", "refused",
                                                                                     "volume_missing")
        assert receipt["locator_after"] == locator
        assert [r for r in fx.requests() if r.seq > mark] == []
        resp = await d.client.get("/metrics")
        assert resp.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        metrics = resp.text
        for status, outcome, n in (("NEW", "succeeded", 1), ("LIVE", "succeeded", 1), ("RESTORED", "succeeded", 2),
                                   ("LOST", "refused", 1)):
            assert sample(metrics, "cloud_agent_turns_total", runtime=runtime, status=status, outcome=outcome) == n
        assert sample(metrics, "cloud_agent_refusals_total", runtime=runtime, reason="volume_missing") == 1
        assert sample(metrics, "cloud_agent_turn_phase_ms_count", runtime=runtime, phase="total") == 5
        assert sample(metrics, "cloud_agent_sandboxes", state="lost") == 1
