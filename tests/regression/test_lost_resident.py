"""A resident member's integrity facts come from the engine's event stream (issue 16), and LOST
does not weaken: a sandbox removed while its member is resident (the container, then its
state volume) is caught by that member's very next turn, which is refused exactly as
``test_lost.test_volume_removed`` refuses it (SPEC 3 and 15: the volume, and with it the
native state, is gone) — the message reaches no CLI and no model, the locator is untouched.

The turn after the sandbox's creation is answered from the facts the creation stored; an
event of the container drops them and the next turn checks against the engine again. The
turn before the removal must have been answered from the event-fed facts (its trace says
``integrity_cached`` and holds no engine inspect): otherwise this test would only repeat the
uncached case.
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from runner import turn
from telemetry.turn_trace import TurnTrace
from tests.regression.conftest import regression_daemon
from tests.regression.test_lost import lost, member, refused, settled_chat
from tests.supervisor_helpers import assert_model_saw, available_runtimes, high_water

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

RUNTIMES = available_runtimes()
TRACES: dict[str, TurnTrace] = {}


@pytest.fixture(scope="module")
async def daemon(fx, sandbox_image, docker_client, tmp_path_factory):
    hooks = turn.TestHooks(turn_trace=lambda trace: TRACES.__setitem__(trace.job_id, trace))
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("lost-resident"),
                                 hooks=hooks) as d:
        yield d


def phases(receipt: dict[str, Any]) -> list[str]:
    return [name for name, _ in TRACES[receipt["job_id"]].marks]


async def live_turn(d, fx, chat, message: str) -> dict[str, Any]:
    reply = chat.expect_turn(message)
    mark = high_water(fx)
    receipt, events, _ = await d.run(chat.job(message))
    assert receipt is not None, events
    assert (receipt["context_status"], receipt["outcome"], receipt["assistant_text"]) == ("LIVE", "succeeded", reply)
    assert_model_saw(fx, mark, chat)
    return receipt


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_sandbox_removed_while_resident(runtime, daemon, fx, docker_client) -> None:
    chat, first = await settled_chat(daemon, fx, runtime)
    saved, volume, cid = first["locator_after"], first["sandbox"]["volume"], first["sandbox"]["container_id"]
    # the sandbox's creation stored what a check would establish: the next turn asks no engine
    created = await live_turn(daemon, fx, chat, "a live turn answered from its sandbox's creation")
    assert "integrity_cached" in phases(created)
    assert "engine_reads" not in phases(created)  # the data root, image, volume and container reads
    # an event of the container (paused, then running again) drops them: the next turn checks
    sup = daemon.daemon.supervisor
    root = (await sup.store.get_sandbox(first["user_id"], first["chat_id"])).data_root_id
    assert sup.manager.integrity.get(cid, root) is not None
    docker_client.api.pause(cid)
    docker_client.api.unpause(cid)
    with anyio.fail_after(10):
        while sup.manager.integrity.get(cid, root) is not None:  # the events reached the daemon
            await anyio.sleep(0.02)
    checked = await live_turn(daemon, fx, chat, "a live turn checked against the engine")
    assert "engine_reads" in phases(checked)  # that check stores its facts again
    cached = await live_turn(daemon, fx, chat, "a live turn answered from the engine's events")
    assert "integrity_cached" in phases(cached)
    assert "engine_reads" not in phases(cached)
    docker_client.api.remove_container(first["sandbox"]["container_id"], force=True)
    docker_client.api.remove_volume(volume)
    assert await refused(daemon, fx, chat) == lost("volume_missing", saved)
    assert await refused(daemon, fx, chat) == lost("previously_lost", saved)
    m = await member(daemon, chat)
    assert (m.locator.id, m.settled_turns, m.lost_reason) == (saved, 4, "volume_missing")
