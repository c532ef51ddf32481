"""State volumes (SPEC 15) through the full stack, for each of the five CLIs: daemon HTTP API
-> runner -> sandbox on its state volume -> real pinned CLI -> loopback fixture.

* **container removed** (``docker rm -f``; the volume intact): the next turn runs in a new
  container on the same volume and is ``RESTORED`` through the CLI's own resume handshake,
  every conversational request carrying the exact history; its receipt says
  ``sandbox.recreated``; the turn after it is ``LIVE`` on that new process.
* **a sandbox made before state volumes** (native state in the container's writable layer,
  recorded without a volume; ``tests/support/legacy_sandbox.py`` makes one from a chat that
  ran real turns) is migrated once by its next turn: ``RESTORED`` with the exact history
  from the moved native state, in a new container on a new volume, the old container gone.
  Where the old container is gone, the chat is refused ``migration_impossible`` and the
  model sees nothing.

The LOST cases of volumes (removed, another chat's swapped in) are in ``test_lost.py``;
image upgrades in ``test_upgrade.py``.
"""

from __future__ import annotations

import pytest

from sandbox_manager.volumes import volume_name
from tests.regression.history_helpers import Member, token
from tests.support.legacy_sandbox import make_legacy
from tests.supervisor_helpers import high_water

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]
RUNTIMES = ["claude", "codex", "pi", "opencode", "kilo"]


def mounts(docker_client, container_id: str) -> list[tuple[str, str, str]]:
    attrs = docker_client.api.inspect_container(container_id)
    return [(m["Type"], m.get("Name", ""), m["Destination"]) for m in attrs["Mounts"] if m["Type"] == "volume"]


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_container_removed_restores_exact_history_in_a_new_container(runtime, daemon, fx,
                                                                           docker_client) -> None:
    m = Member(daemon, fx, runtime)
    await m.turn(token("first: remember the word anemone"), "NEW")
    before = await m.turn(token("second: and the number 42"), "LIVE")
    old = before.receipt["sandbox"]
    assert old["volume"] and old["recreated"] is False
    docker_client.api.remove_container(old["container_id"], force=True)
    restored = await m.turn(token("the container was removed: what did I ask you to remember?"), "RESTORED")
    new = restored.receipt["sandbox"]
    assert new["container_id"] != old["container_id"]
    assert (new["volume"], new["image_id"], new["recreated"]) == (old["volume"], old["image_id"], True)
    assert restored.receipt["upgraded_from"] is None
    assert restored.receipt["locator_before"] == restored.receipt["locator_after"] == before.receipt["locator_after"]
    assert mounts(docker_client, new["container_id"]) == [("volume", old["volume"], "/home/agent")]
    after = await m.turn(token("and once more"), "LIVE")
    assert (after.receipt["sandbox"]["container_id"], after.receipt["sandbox"]["recreated"]) == \
        (new["container_id"], False)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_container_removed_whose_events_come_late_is_restored_within_the_next_turn(
        runtime, daemon, fx, docker_client, monkeypatch) -> None:
    """The engine's events of the removal reach the daemon only once the next turn has run on
    the facts they would have spoiled (held back here until the turn asks for them; CI saw it
    happen on its own): the turn's CLI link ends before any output, the container's die came
    before the turn wrote its message, and the same turn is RESTORED on a new container with the
    exact history (SPEC 15, issue 16) — not a LIVE not_settled."""
    m = Member(daemon, fx, runtime)
    await m.turn(token("first: remember the word anemone"), "NEW")
    before = await m.turn(token("second: and the number 42"), "LIVE")
    old = before.receipt["sandbox"]["container_id"]
    integrity = daemon.daemon.supervisor.manager.integrity
    apply, ask = integrity.apply, integrity.stopped_between
    held: list[dict] = []
    asked: list[str] = []

    def hold(event: dict) -> None:
        if (event.get("Actor") or {}).get("ID") == old:
            held.append(event)
        else:
            apply(event)

    async def late(container_id: str, *args, **kwargs) -> bool:
        asked.append(container_id)
        for event in held:  # the events reach the daemon now, while the turn asks
            apply(event)
        held.clear()
        return await ask(container_id, *args, **kwargs)

    monkeypatch.setattr(integrity, "apply", hold)
    monkeypatch.setattr(integrity, "stopped_between", late)
    docker_client.api.remove_container(old, force=True)
    restored = await m.turn(token("the container was removed: what did I ask you to remember?"), "RESTORED")
    assert asked == [old]
    sb = restored.receipt["sandbox"]
    assert sb["container_id"] != old and sb["recreated"] is True and sb["volume"] == before.receipt["sandbox"]["volume"]
    assert restored.receipt["locator_before"] == restored.receipt["locator_after"] == before.receipt["locator_after"]
    statuses = [e["context_status"] for e in restored.events if e.get("type") == "status"]
    assert statuses == ["LIVE", "RESTORED"]
    await m.turn(token("and once more"), "LIVE")


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_sandbox_made_before_state_volumes_is_migrated_and_restored(runtime, daemon, fx,
                                                                            docker_client) -> None:
    m = Member(daemon, fx, runtime)
    await m.turn(token("before volumes: remember the colour teal"), "NEW")
    before = await m.turn(token("and the animal heron"), "LIVE")
    await m.retire()
    legacy = await make_legacy(daemon.daemon.supervisor.manager, m.user_id, m.chat_id)
    assert mounts(docker_client, legacy.container_id) == []  # the native state is in its writable layer
    restored = await m.turn(token("after the migration: which colour and animal?"), "RESTORED")
    sb = restored.receipt["sandbox"]
    assert sb["container_id"] != legacy.container_id and sb["recreated"] is True
    assert sb["volume"] == volume_name(legacy.container_name)
    assert restored.receipt["locator_after"] == before.receipt["locator_after"]
    assert mounts(docker_client, sb["container_id"]) == [("volume", sb["volume"], "/home/agent")]
    assert docker_client.api.containers(all=True, filters={"id": legacy.container_id}) == []
    rec = await daemon.daemon.supervisor.store.get_sandbox(m.user_id, m.chat_id)
    assert (rec.container_id, rec.volume_name) == (sb["container_id"], sb["volume"])
    await m.turn(token("and on the volume from now on"), "LIVE")


async def test_a_sandbox_made_before_state_volumes_without_its_container_is_refused(daemon, fx,
                                                                                     docker_client) -> None:
    m = Member(daemon, fx, "codex")
    first = await m.turn(token("settle before the container goes"), "NEW")
    await m.retire()
    legacy = await make_legacy(daemon.daemon.supervisor.manager, m.user_id, m.chat_id)
    docker_client.api.remove_container(legacy.container_id, force=True)
    for reason in ("migration_impossible", "previously_lost"):
        mark = high_water(fx)
        t = await m.send("this must never reach a model")
        r = t.receipt
        assert (r["context_status"], r["outcome"], r["reason"]) == ("LOST", "refused", reason), t.describe()
        assert r["locator_before"] == r["locator_after"] == first.receipt["locator_after"]
        assert [q for q in fx.requests() if q.seq > mark] == []
    assert "nothing to move to a volume" in (m.turns[-2].receipt["settlement"]["detail"] or "")
