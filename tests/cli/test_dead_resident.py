"""A resident CLI that died between turns, over the production exec stream.

The daemon keeps a member's process for its next LIVE turn. When that process is killed while
idle, nothing has read the stream's EOF yet, so the next job still picks the resident (LIVE) and
writes to an exec whose process is gone (the engine still accepts the bytes). That must be an
ordinary unsettled turn — receipt ``not_settled`` / ``transport_closed``, no model request,
nothing saved, the process retired — and the turn after it RESTORES the member.
"""

from __future__ import annotations

import anyio
import pytest

from deploy.loopback import LoopbackFixture
from runner import event_loop
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import (
    Chat,
    assert_model_saw,
    high_water,
    runtimes_one_per_bridge,
)

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def anyio_backend() -> tuple[str, dict]:
    return event_loop.BACKEND, event_loop.BACKEND_OPTIONS  # the product's loop


@pytest.fixture(scope="module")
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


@pytest.fixture(scope="module")
async def daemon(fx, sandbox_image, tmp_path_factory):
    home = tmp_path_factory.mktemp("dead-resident") / "home"
    async with running_daemon(daemon_settings(home, fx.base_url, sandbox_image)) as d:
        yield d


def kill_group(docker_client, container_id: str, pidfile: str) -> None:
    rc, out = docker_client.containers.get(container_id).exec_run(
        ["sh", "-c", 'pg=$(cat "$1") && kill -s KILL -- "-$pg" && while kill -s 0 -- "-$pg" 2>/dev/null; do :; done',
         "sh", pidfile], user="agent")
    assert rc == 0, out


@pytest.mark.parametrize("runtime", runtimes_one_per_bridge())
async def test_resident_killed_between_turns_is_transport_closed_then_restored(
        runtime: str, daemon, fx, docker_client) -> None:
    chat = Chat(runtime)
    chat.expect_turn("first question")
    first, events, _ = await daemon.run(chat.job("first question"))
    assert first is not None and (first["context_status"], first["outcome"]) == ("NEW", "succeeded"), events
    key = (chat.user_id, chat.chat_id, chat.member_id)
    resident = daemon.daemon.supervisor.pool.get(key)
    assert resident is not None and resident.alive
    kill_group(docker_client, resident.container_id, resident.pidfile)

    mark = high_water(fx)
    with anyio.fail_after(300):
        lost, events, _ = await daemon.run(chat.job("this turn meets a dead process"))
    assert [e for e in events if e.get("type") == "error"] == []
    assert lost is not None, events
    assert (lost["context_status"], lost["outcome"], lost["reason"]) == ("LIVE", "not_settled", "transport_closed")
    assert lost["locator_after"] == first["locator_after"]  # nothing saved
    assert [r for r in fx.requests() if r.seq > mark and r.kind == "conversation"] == []
    assert daemon.daemon.supervisor.pool.get(key) is None  # retired

    chat.expect_turn("after the restart")
    mark = high_water(fx)
    again, events, _ = await daemon.run(chat.job("after the restart"))
    assert again is not None and (again["context_status"], again["outcome"]) == ("RESTORED", "succeeded"), events
    assert again["locator_after"] == first["locator_after"]
    assert_model_saw(fx, mark, chat)
