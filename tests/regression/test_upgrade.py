"""A real image upgrade (SPEC 15): chats made on the product's image continue on a second
image whose Claude pin really moved (2.1.220 -> 2.1.332), for each of the five CLIs.

The second image is built from ``tests/data/upgrade/pins.toml`` (the product's pins with the
one Claude pin changed; ``images/pins.toml`` stays as SPEC 10 fixes it) by the product's own
build script, once per machine: its tag is derived from that file, so later runs find it
cached. The module prints how long getting it took.

A first daemon on the product image settles, per runtime, one chat with two members:

* ``m1``: two turns (NEW, LIVE);
* ``m2``: one turn, then its CLI's native session state is deleted (as ``agent``, after its
  process was retired): the new image's CLI will have nothing to confirm its locator with.

A second daemon on the same home is configured with the second image (and, through a test
hook, the pins it must carry). Each chat's next turn replaces its container by one from the
new image on the same volume. Then:

* ``m1`` is RESTORED through the new CLI's own resume handshake, every conversational
  request carrying the exact history; its receipt names ``upgraded_from`` (the first image
  and the CLI version its native state was last verified with); Claude's receipt proves the
  real version change (2.1.220 -> 2.1.332), the other CLIs the generic path; the turn after
  it is LIVE and names no upgrade;
* ``m2`` is refused LOST ``upgrade_incompatible`` (never NEW), zero model requests, and
  stays LOST.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from images.build import ensure_image
from images.pins import load_pins
from runner.turn import TestHooks as Hooks  # not collected as a test class
from tests.daemon_harness import RunningDaemon, daemon_settings
from tests.regression.conftest import print_report, recorded_daemon, remove_host_containers
from tests.regression.history_helpers import Member, TurnResult, token
from tests.regression.native_state import agent_sh, native_state_paths
from tests.supervisor_helpers import high_water

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]
RUNTIMES = ["claude", "codex", "pi", "opencode", "kilo"]
UPGRADE_PINS = Path(__file__).resolve().parents[1] / "data" / "upgrade" / "pins.toml"
_REPORT: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def _print_report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    print_report(request, _REPORT)


@pytest.fixture(scope="module")
def upgrade_image(sandbox_image: str, docker_client: Any) -> str:
    """The second image: built on first use on this machine, then cached by its tag."""
    t0 = time.monotonic()
    tag = ensure_image(pins_file=UPGRADE_PINS)
    took = time.monotonic() - t0
    _REPORT.append(f"upgrade image {tag} ({docker_client.images.get(tag).id[:19]}): ready in {took:.1f}s "
                   f"({'built' if took > 30 else 'cached'})")
    assert tag != sandbox_image
    return tag


@dataclass
class UpgradeChat:
    m1: Member
    m2: Member
    before: TurnResult  # m1's last turn on the first image
    image_id: str  # the first image's id


@pytest.fixture(scope="module")
async def upgraded(fx, sandbox_image, upgrade_image, docker_client,
                   tmp_path_factory) -> AsyncIterator[tuple[RunningDaemon, dict[str, UpgradeChat]]]:
    home = tmp_path_factory.mktemp("upgrade") / "home"
    first = daemon_settings(home, fx.base_url, sandbox_image)
    chats: dict[str, UpgradeChat] = {}
    try:
        async with recorded_daemon(first) as d1:
            for runtime in RUNTIMES:
                m1 = Member(d1, fx, runtime)
                await m1.turn(token("on the first image: remember the word saffron"), "NEW")
                before = await m1.turn(token("and the city Lisbon"), "LIVE")
                m2 = m1.sibling("m2", [])
                await m2.turn(token("the second member's only turn"), "NEW")
                await m2.retire()
                rec = await d1.daemon.supervisor.store.get_member(m2.user_id, m2.chat_id, m2.member_id)
                words = native_state_paths(runtime, rec)
                code, out = agent_sh(docker_client, before.receipt["sandbox"]["container_id"],
                                     f"rm -f -- {words} && ! ls {words} 2>/dev/null")
                assert code == 0, out
                chats[runtime] = UpgradeChat(m1, m2, before, before.receipt["sandbox"]["image_id"])
        second = daemon_settings(home, fx.base_url, upgrade_image)
        async with recorded_daemon(second, hooks=Hooks(pins=load_pins(UPGRADE_PINS))) as d2:
            for chat in chats.values():
                chat.m1.d = chat.m2.d = d2
            yield d2, chats
    finally:
        remove_host_containers(docker_client, first.resolved_host_id())


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_an_upgrade_restores_exact_history_through_the_new_cli(runtime, upgraded, docker_client,
                                                                    upgrade_image) -> None:
    _, chats = upgraded
    chat = chats[runtime]
    new_image = docker_client.images.get(upgrade_image).id
    assert new_image != chat.image_id
    t = await chat.m1.turn(token("after the upgrade: which word and which city?"), "RESTORED")
    r = t.receipt
    assert r["upgraded_from"] == {"image_id": chat.image_id, "cli_version": chat.before.receipt["cli_version"]}
    assert (r["sandbox"]["image_id"], r["sandbox"]["volume"], r["sandbox"]["recreated"]) == \
        (new_image, chat.before.receipt["sandbox"]["volume"], True)
    assert r["sandbox"]["container_id"] != chat.before.receipt["sandbox"]["container_id"]
    assert r["locator_before"] == r["locator_after"] == chat.before.receipt["locator_after"]
    assert docker_client.api.inspect_container(r["sandbox"]["container_id"])["Image"] == new_image
    if runtime == "claude":  # a real CLI version change, reported by the CLI itself
        assert (chat.before.receipt["cli_version"], r["cli_version"]) == ("2.1.220", "2.1.332")
    else:
        assert r["cli_version"] == chat.before.receipt["cli_version"]
    after = await chat.m1.turn(token("and after that, once more"), "LIVE")
    assert (after.receipt["upgraded_from"], after.receipt["sandbox"]["recreated"]) == (None, False)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_resume_the_new_cli_cannot_confirm_is_upgrade_incompatible(runtime, upgraded, fx) -> None:
    _, chats = upgraded
    chat = chats[runtime]
    for reason in ("upgrade_incompatible", "previously_lost"):
        mark = high_water(fx)
        t = await chat.m2.send("this must never reach a model")
        r = t.receipt
        assert (r["context_status"], r["outcome"], r["reason"]) == ("LOST", "refused", reason), t.describe()
        assert [q for q in fx.requests() if q.seq > mark] == []
        assert r["locator_before"] == r["locator_after"] == chat.m2.turns[0].receipt["locator_after"]
    refusal = chat.m2.turns[-2].receipt
    assert refusal["upgraded_from"] == {"image_id": chat.image_id,
                                        "cli_version": chat.m2.turns[0].receipt["cli_version"]}
    assert refusal["settlement"]["detail"].startswith("native_state_missing")
