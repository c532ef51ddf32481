"""LOST regressions (SPEC 3, 4.3, 7): when the native state or the sandbox's integrity cannot
be established, the turn is refused as LOST — nothing reaches any CLI or the model — and a
LOST member stays LOST.

Every case runs for every runtime: one member with a settled turn (its own chat), then the
damage, then a refused job with the exact reason and zero fixture requests, then a second
job refused as ``previously_lost``.

The native state lives on the chat's state volume (SPEC 15): a removed container is no
longer a LOST case — the next turn is RESTORED in a new container on the same volume
(``test_volumes.py``). What loses the native state is the volume.

=====================  ============================================  ========================
case                   damage                                        reason
=====================  ============================================  ========================
volume removed         ``docker rm -f`` of the chat's container,     ``volume_missing``
                       then ``docker volume rm`` of its volume
another chat's volume  the chat's volume replaced by one with its    ``volume_mismatch``
swapped in             name and exact labels holding another chat's
                       home (that chat's identity marker inside)
data root changed      the data-root marker volume carries another   ``data_root_changed``
                       id (restored in ``finally``)
labels tampered        the recorded container is one whose identity  ``labels_mismatch``
                       labels name another chat
locator missing        the store keeps the settled turns, loses the  ``member_locator_missing``
                       locator (``tests.support.store.erase_locator``)
native state deleted   the CLI's own session state, deleted as       ``native_state_missing``
                       ``agent`` after the resident was retired
=====================  ============================================  ========================

The data-root case swaps the engine-wide marker volume ``cloud-agent-dataroot-identity``:
every other sandbox on this engine depends on it, so it must never run concurrently with
other tests; the swap lasts only as long as the refusals take, and the original id is put
back in a ``finally`` (a bystander chat proves the restore: it works again afterwards).
"""

from __future__ import annotations

import shlex
import time
from typing import Any

import docker.errors
import pytest

from sandbox_manager.engine import DATA_ROOT_LABEL, DATA_ROOT_VOLUME
from sandbox_manager.identity import LABEL_CHAT, LABEL_IDENTITY, digest
from state.records import MemberRecord
from tests.regression.conftest import regression_daemon
from tests.regression.native_state import agent_sh, native_state_paths
from tests.supervisor_helpers import Chat, assert_model_saw, available_runtimes, high_water
from tests.support.store import erase_locator

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

RUNTIMES = available_runtimes()


@pytest.fixture(scope="module")
async def daemon(fx, sandbox_image, docker_client, tmp_path_factory):
    # No periodic reverse probe: it would (re)create the data-root marker during the swap.
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("lost"),
                                 probe_interval_s=3600) as d:
        yield d


# ---------------------------------------------------------------- helpers


async def settled_chat(d, fx, runtime: str) -> tuple[Chat, dict[str, Any]]:
    """A new chat whose member has one settled turn (the model saw exactly that turn)."""
    chat = Chat(runtime)
    message = f"settle one turn of {runtime} before the damage"
    reply = chat.expect_turn(message)
    mark = high_water(fx)
    receipt, events, _ = await d.run(chat.job(message))
    assert receipt is not None, events
    assert (receipt["context_status"], receipt["outcome"], receipt["assistant_text"]) == \
        ("NEW", "succeeded", reply), (receipt["reason"], receipt["settlement"])
    assert receipt["locator_after"]
    assert_model_saw(fx, mark, chat)
    return chat, receipt


async def refused(d, fx, chat: Chat) -> tuple[str, str, str | None, int, str | None, str | None]:
    """Run one job; (status, outcome, reason, fixture requests it caused, locator before/after)."""
    mark = high_water(fx)
    receipt, events, resp = await d.run(chat.job("this must never reach a model"))
    assert resp.status_code == 200 and receipt is not None, events
    return (receipt["context_status"], receipt["outcome"], receipt["reason"], len(fx.requests(since=mark)),
            receipt["locator_before"], receipt["locator_after"])


def lost(reason: str, locator: str | None) -> tuple[str, str, str, int, str | None, str | None]:
    """What a LOST refusal must look like: zero fixture requests, the locator untouched."""
    return ("LOST", "refused", reason, 0, locator, locator)


async def member(d, chat: Chat) -> MemberRecord:
    m = await d.daemon.supervisor.store.get_member(chat.user_id, chat.chat_id, chat.member_id)
    assert m is not None
    return m


async def retire(d, chat: Chat) -> None:
    resp = await d.client.post(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}/members/{chat.member_id}/retire")
    assert resp.json() == {"retired": True}


# ---------------------------------------------------------------- sandbox-level cases


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_volume_removed(runtime, daemon, fx, docker_client) -> None:
    chat, first = await settled_chat(daemon, fx, runtime)
    saved, volume = first["locator_after"], first["sandbox"]["volume"]
    docker_client.api.remove_container(first["sandbox"]["container_id"], force=True)
    docker_client.api.remove_volume(volume)
    assert await refused(daemon, fx, chat) == lost("volume_missing", saved)
    assert await refused(daemon, fx, chat) == lost("previously_lost", saved)
    m = await member(daemon, chat)
    assert (m.locator.id, m.settled_turns, m.lost_reason) == (saved, 1, "volume_missing")
    # no fresh volume or container was made up for it
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_volume(volume)
    assert docker_client.api.containers(all=True, filters={"label": f"{LABEL_IDENTITY}="
                                                           f"{digest('sandbox', chat.user_id, chat.chat_id)}"}) == []


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_another_chats_volume_swapped_in(runtime, daemon, fx, docker_client) -> None:
    chat, first = await settled_chat(daemon, fx, runtime)
    other, other_first = await settled_chat(daemon, fx, runtime)
    saved, volume = first["locator_after"], first["sandbox"]["volume"]
    labels = docker_client.api.inspect_volume(volume)["Labels"]
    docker_client.api.remove_container(first["sandbox"]["container_id"], force=True)
    docker_client.api.remove_volume(volume)
    # a volume with this chat's name and exact labels, holding the other chat's home
    docker_client.api.create_volume(volume, labels=labels)
    carrier = docker_client.containers.create(docker_client.api.inspect_container(
        other_first["sandbox"]["container_id"])["Image"], command=["true"], network_mode="none",
        volumes={volume: {"bind": "/home/agent", "mode": "rw"}})
    try:
        bits, _ = docker_client.api.get_archive(other_first["sandbox"]["container_id"], "/home/agent")
        assert docker_client.api.put_archive(carrier.id, "/home", b"".join(bits))
    finally:
        carrier.remove(force=True)
    assert await refused(daemon, fx, chat) == lost("volume_mismatch", saved)
    assert await refused(daemon, fx, chat) == lost("previously_lost", saved)
    assert (await member(daemon, chat)).lost_reason == "volume_mismatch"
    # the other chat, whose home was copied, goes on undisturbed
    message = "the other chat after the swap"
    reply = other.expect_turn(message)
    mark = high_water(fx)
    receipt, _, _ = await daemon.run(other.job(message))
    assert (receipt["context_status"], receipt["outcome"], receipt["assistant_text"]) == ("LIVE", "succeeded", reply)
    assert_model_saw(fx, mark, other)


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_identity_labels_tampered(runtime, daemon, fx, docker_client) -> None:
    chat, first = await settled_chat(daemon, fx, runtime)
    saved = first["locator_after"]
    original = docker_client.containers.get(first["sandbox"]["container_id"])
    name, image, labels = original.name, original.image.id, dict(original.labels)
    # The recorded container now carries identity labels naming another chat (everything else
    # — name, image, host, data root — as before): Docker labels are immutable, so the record
    # is pointed at a container created with the tampered set.
    labels[LABEL_CHAT] = digest("chat", "some-other-chat")[:32]
    original.remove(force=True)
    forged = docker_client.containers.create(image, command=["sleep", "infinity"], name=name, labels=labels,
                                             init=True, network_mode="none")
    store = daemon.daemon.supervisor.store
    rec = await store.get_sandbox(chat.user_id, chat.chat_id)
    await store.put_sandbox(rec.model_copy(update={"container_id": forged.id}))
    assert await refused(daemon, fx, chat) == lost("labels_mismatch", saved)
    assert await refused(daemon, fx, chat) == lost("previously_lost", saved)
    forged.reload()
    assert forged.status == "created", "a LOST sandbox is never started"


async def test_data_root_changed(daemon, fx, docker_client) -> None:
    chats = [await settled_chat(daemon, fx, runtime) for runtime in RUNTIMES]
    bystander, _ = await settled_chat(daemon, fx, "codex")  # untouched while the id is swapped
    original = data_root_id(docker_client)
    assert original == (await daemon.daemon.supervisor.store.get_sandbox(chats[0][0].user_id,
                                                                          chats[0][0].chat_id)).data_root_id
    for chat, _ in chats:
        await retire(daemon, chat)  # keeps the swap short: a refusal retires the chat's residents
    got: dict[str, Any] = {}
    t0 = time.monotonic()
    try:
        set_data_root_id(docker_client, f"another-data-root-{original[:8]}")
        for chat, _ in chats:
            got[chat.runtime] = await refused(daemon, fx, chat)
    finally:
        set_data_root_id(docker_client, original)
        print(f"data-root identity swapped for {time.monotonic() - t0:.3f}s")
    assert data_root_id(docker_client) == original
    assert got == {chat.runtime: lost("data_root_changed", first["locator_after"]) for chat, first in chats}
    # LOST stays LOST, even with the original data root back
    for chat, first in chats:
        assert await refused(daemon, fx, chat) == lost("previously_lost", first["locator_after"])
    # the restored id is the one every other sandbox was created in: the bystander just goes on
    bystander.expect_turn("after the data root came back")
    mark = high_water(fx)
    receipt, _, _ = await daemon.run(bystander.job("after the data root came back"))
    assert (receipt["context_status"], receipt["outcome"]) == ("LIVE", "succeeded")
    assert_model_saw(fx, mark, bystander)


def data_root_id(docker_client) -> str | None:
    try:
        vol = docker_client.volumes.get(DATA_ROOT_VOLUME)
    except docker.errors.NotFound:
        return None
    return (vol.attrs.get("Labels") or {}).get(DATA_ROOT_LABEL)


def set_data_root_id(docker_client, ident: str) -> None:
    """Replace the marker volume by one labelled ``ident`` (labels are immutable).

    ``volume create`` of an existing name returns the existing volume unchanged, so a daemon
    that re-created the marker in between would win silently: read back and retry.
    """
    for _ in range(20):
        try:
            docker_client.volumes.get(DATA_ROOT_VOLUME).remove(force=True)
        except docker.errors.NotFound:
            pass
        try:
            docker_client.volumes.create(name=DATA_ROOT_VOLUME, labels={DATA_ROOT_LABEL: ident})
        except docker.errors.APIError:
            pass
        if data_root_id(docker_client) == ident:
            return
    raise AssertionError(f"could not set the data-root identity to {ident}")


# ---------------------------------------------------------------- member-level cases


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_member_locator_missing(runtime, daemon, fx) -> None:
    chat, _ = await settled_chat(daemon, fx, runtime)
    erase_locator(daemon.daemon.supervisor.store, chat.user_id, chat.chat_id, chat.member_id)
    await retire(daemon, chat)
    assert await refused(daemon, fx, chat) == lost("member_locator_missing", None)
    assert await refused(daemon, fx, chat) == lost("previously_lost", None)
    m = await member(daemon, chat)
    assert (m.locator, m.settled_turns, m.lost_reason) == (None, 1, "member_locator_missing")


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_native_state_deleted(runtime, daemon, fx, docker_client) -> None:
    chat, first = await settled_chat(daemon, fx, runtime)
    saved, container = first["locator_after"], first["sandbox"]["container_id"]
    await retire(daemon, chat)  # the next turn must start a process and restore
    words = native_state_paths(runtime, await member(daemon, chat))
    _, listed = agent_sh(docker_client, container, f"ls -1d {words} 2>/dev/null; true")
    found = listed.split()
    if runtime in ("opencode", "kilo"):
        assert found[0] == shlex.split(words)[0], found  # the database (its WAL files may be there too)
    elif runtime == "pi":
        assert found == [(await member(daemon, chat)).locator.path], found
    else:
        assert len(found) == 1 and found[0].endswith(f"{saved}.jsonl"), found
    code, out = agent_sh(docker_client, container, f"rm -f -- {words} && ! ls {words} 2>/dev/null")
    assert code == 0, out
    assert await refused(daemon, fx, chat) == lost("native_state_missing", saved)
    assert await refused(daemon, fx, chat) == lost("previously_lost", saved)
    m = await member(daemon, chat)
    assert (m.locator.id, m.settled_turns, m.lost_reason) == (saved, 1, "native_state_missing")
    # member-level: the sandbox itself is fine (another member of the chat could still run)
    status = (await daemon.client.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()
    assert (status["sandbox"]["state"], status["members"][0]["resident"]) == ("running", False)
