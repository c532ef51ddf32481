"""The sandbox manager against the real engine and the pinned image."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import uuid

import anyio
import docker.errors
import pytest

from images.identity import carries_bridge
from images.pins import load_pins
from sandbox_manager import launch_files
from sandbox_manager.engine import ContainerInfo, DockerEngine, FileEntry
from sandbox_manager.identity import LABEL_IDENTITY, LostReason, Replaced, SandboxLost, container_name, digest
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.volumes import LABEL_VOLUME_ID, MARKER_PATH, marker_bytes, volume_name
from state.records import SandboxState
from state.store import Store
from tests.cli.attestation_helpers import relabelled_image
from tests.support.legacy_sandbox import legacy_sandbox
from tests.support.sandbox import processes
from tests.support.store import rows

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture
def manager(tmp_path, sandbox_image, docker_client):
    engine = DockerEngine()
    store = Store(tmp_path / "store.db")
    mgr = SandboxManager(engine, store, SandboxConfig(image=sandbox_image, socket_root=str(tmp_path / "sockets"), host_id="test-host",
                                                      require_helper=carries_bridge(load_pins())))
    created: list[str] = []
    mgr._test_created = created  # type: ignore[attr-defined]
    yield mgr
    for rec in rows(store, "sandboxes"):
        name = rec["container_name"]
        for ref in (rec["container_id"], name, f"{name}-premigration"):
            try:
                docker_client.api.remove_container(ref, force=True)
            except Exception:
                pass
        try:
            docker_client.api.remove_volume(f"{name}-home")
        except Exception:
            pass
    store.close()
    engine.close()


def ids() -> tuple[str, str]:
    return f"user-{uuid.uuid4().hex[:8]}", f"chat-{uuid.uuid4().hex[:8]}"


async def test_create_hardened_and_retained(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    assert sb.created and sb.container.running
    attrs = docker_client.api.inspect_container(sb.container_id)
    host = attrs["HostConfig"]
    assert attrs["Name"] == "/" + container_name(user, chat)
    assert user not in attrs["Name"] and chat not in attrs["Name"]
    assert host["Init"] is True
    assert host["CapDrop"] == ["ALL"]
    assert "no-new-privileges" in host["SecurityOpt"]
    assert host["Privileged"] is False
    assert host["NetworkMode"] == "none"
    assert host["Memory"] > 0 and host["PidsLimit"] > 0
    assert host["MemorySwap"] == host["Memory"]  # no swap beyond the memory limit
    assert attrs["Config"]["User"] == "agent"
    # two mounts (SPEC 7, 15): the chat's state volume at the agent's home (labelled like the
    # container), and its own model socket directory, read-only
    vol = volume_name(container_name(user, chat))
    assert sorted((m["Type"], m.get("Name") or m["Source"], m["Destination"], m["RW"]) for m in attrs["Mounts"]) == [
        ("bind", str(manager.socket_dir(user, chat)), "/run/cloud-agent/model", False),
        ("volume", vol, "/home/agent", True)]
    assert attrs["Config"]["Cmd"] == ["ca-modelgate", "--socket", "/run/cloud-agent/model/model.sock",
                                      "--listen", "127.0.0.1:18080", "--marker", "/home/agent/.cloud-agent-volume"]
    rec = await manager.store.get_sandbox(user, chat)
    assert rec.volume_name == vol and len(rec.volume_id) == 32
    labels = docker_client.api.inspect_volume(vol)["Labels"]
    identity = manager.identity_labels(user, chat, rec.data_root_id)
    assert labels == {**identity, LABEL_VOLUME_ID: rec.volume_id}
    assert all(attrs["Config"]["Labels"][k] == v for k, v in identity.items())
    # its identity marker: root-owned, read-only, naming the chat and the volume id
    code, out = await manager.engine.exec_run(sb.container_id, ["stat", "-c", "%U %a", MARKER_PATH])
    assert (code, out) == (0, b"root 444\n")
    assert json.loads(await manager.engine.read_file(sb.container_id, MARKER_PATH)) == \
        {"identity": digest("sandbox", user, chat), "volume_id": rec.volume_id}
    # retained: a file survives stop/start
    code, _ = await manager.engine.exec_run(sb.container_id, ["sh", "-c", "echo kept > /home/agent/workspace/m"])
    assert code == 0
    assert await manager.stop(user, chat)
    assert (await manager.store.get_sandbox(user, chat)).state == SandboxState.STOPPED
    again = await manager.resolve(user, chat)
    assert again.container_id == sb.container_id and again.started and not again.created
    code, out = await manager.engine.exec_run(sb.container_id, ["cat", "/home/agent/workspace/m"])
    assert (code, out) == (0, b"kept\n")


async def test_a_new_volumes_marker_is_written_from_the_host(manager: SandboxManager, monkeypatch) -> None:
    """The marker goes into the new volume's content before its container first starts, not
    through the archive API (issue 16: that call was ~57 ms of a ~265 ms create); where the
    content cannot be reached from here, the archive API writes it."""
    archived: list[str] = []
    real_put = manager.engine.put_root_file

    async def put_root_file(container_id: str, path: str, content: bytes, mode: int = 0o444) -> None:
        archived.append(path)
        await real_put(container_id, path, content, mode)

    monkeypatch.setattr(manager.engine, "put_root_file", put_root_file)
    for reachable in (True, False):
        if not reachable:
            monkeypatch.setattr("sandbox_manager.chat_containers.put_root_file", lambda *a: False)
        user, chat = ids()
        sb = await manager.resolve(user, chat)
        manager.release(sb)
        assert archived == ([] if reachable else [MARKER_PATH])
        code, out = await manager.engine.exec_run(sb.container_id, ["stat", "-c", "%U %G %a", MARKER_PATH])
        assert (code, out) == (0, b"root root 444\n")
        assert json.loads(await manager.engine.read_file(sb.container_id, MARKER_PATH)) == \
            {"identity": digest("sandbox", user, chat), "volume_id": sb.record.volume_id}
        # the next start reads it through the gate and finds it the chat's
        assert await manager.stop(user, chat)
        again = await manager.resolve(user, chat)
        manager.release(again)
        assert again.container_id == sb.container_id and again.started


async def test_new_sandboxes_take_the_image_check_and_data_root_from_event_fed_facts(manager: SandboxManager,
                                                                                   docker_client, sandbox_image) -> None:
    """While the engine's event stream is followed, the image check and the data root identity
    are asked of the engine once, not for every new sandbox (issue 16); a tag moved in the
    engine (an image event) makes the next new sandbox ask again."""
    asked: list[str] = []
    engine = manager.engine
    real_image, real_root = engine.image, engine.data_root_identity

    async def image(ref: str):
        asked.append("image")
        return await real_image(ref)

    async def data_root_identity(*, create: bool):
        asked.append("data_root")
        return await real_root(create=create)

    engine.image, engine.data_root_identity = image, data_root_identity  # type: ignore[method-assign]
    retag = f"cloud-agent-test-retag-{uuid.uuid4().hex[:8]}"
    async with anyio.create_task_group() as tg:
        tg.start_soon(manager.integrity.follow)
        with anyio.fail_after(10):
            while not manager.integrity.live:
                await anyio.sleep(0.01)
        try:
            for n in range(3):
                if n == 2:
                    docker_client.images.get(sandbox_image).tag(retag, "x")
                    with anyio.fail_after(10):
                        while manager.integrity.engine_fact(f"image:{sandbox_image}") is not None:
                            await anyio.sleep(0.01)
                sb = await manager.resolve(*ids())
                manager.release(sb)
                assert sb.created and sb.record.data_root_id
                assert asked == ["image", "data_root"] * (1 if n < 2 else 2), n
        finally:
            with contextlib.suppress(docker.errors.ImageNotFound):  # a run that failed before the tag
                docker_client.images.remove(f"{retag}:x")
            tg.cancel_scope.cancel()


async def test_attached_exec_round_trip_and_group_kill(manager: SandboxManager) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    dirs = manager.member_dirs("m1")
    files = launch_files.encode([FileEntry(f"{dirs.home}/conf.json", b'{"a": 1}\n')], [], [dirs.run_dir])
    pidfile = f"{dirs.run_dir}/cli.pid"
    argv = ["ca-launch", "--pidfile", pidfile, "--cwd", dirs.workspace, "--files-on-stdin", "--",
            "sh", "-c", 'echo "plain=$PLAIN"; cat "$0"; sleep 300 & exec cat', f"{dirs.home}/conf.json"]
    proc = await manager.launch(sb, argv=argv, env={"PLAIN": "1"}, workdir="/home/agent", pidfile=pidfile,
                                files=files)
    with anyio.fail_after(20):
        assert await proc.stream.receive() == b"plain=1"
        assert await proc.stream.receive() == b'{"a": 1}'
        payload = "多段\n".encode()
        await proc.stream.send(b'{"hello": "\xe4\xb8\x96\xe7\x95\x8c"}')
        assert await proc.stream.receive() == b'{"hello": "\xe4\xb8\x96\xe7\x95\x8c"}'
        assert payload
    procs = await processes(manager.engine, sb.container_id)
    pg = next(p["pgid"] for p in procs if p["comm"] == "cat")
    assert any(p["comm"] == "sleep" and p["pgid"] == pg for p in procs)
    await manager.kill_group(sb.container_id, pidfile)
    with anyio.fail_after(10):
        while await proc.stream.receive() is not None:
            pass
    procs = await processes(manager.engine, sb.container_id)
    assert not [p for p in procs if p["pgid"] == pg], procs
    assert not [p for p in procs if "Z" in p["stat"]], "killed processes must be reaped (init=True)"
    await proc.stream.aclose()


async def test_launch_precheck_failure_is_a_line(manager: SandboxManager) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    argv = ["ca-launch", "--pidfile", "/home/agent/x.pid", "--require-file", "/home/agent/nope.jsonl", "--", "true"]
    proc = await manager.launch(sb, argv=argv, env={}, workdir="/home/agent", pidfile="/home/agent/x.pid")
    with anyio.fail_after(10):
        line = await proc.stream.receive()
        assert json.loads(line) == {"type": "launch_error", "reason": "missing_file", "path": "/home/agent/nope.jsonl"}
        assert await proc.stream.receive() is None
    assert await manager.engine.exec_exit_code(proc.stream.exec_id) == 3


async def test_a_new_sandbox_is_handed_over_without_waiting_for_its_gate_and_a_launch_waits_for_it(
        manager: SandboxManager, monkeypatch) -> None:
    """Issue 16: the gate's listening line came 6-9 ms after the start, and a new sandbox's
    resolve waited for it. Now the launcher waits for the gate instead (``--await-listen``,
    read from the sandbox's own /proc/net/tcp as the agent): a new sandbox's resolve reads no
    log line, a restart still does (the marker's verdict comes from it)."""
    waited: list[str] = []
    real_wait = manager.engine.wait_log_line

    async def wait_log_line(container_id: str, *args, **kwargs):
        waited.append(container_id)
        return await real_wait(container_id, *args, **kwargs)

    monkeypatch.setattr(manager.engine, "wait_log_line", wait_log_line)
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    manager.release(sb)
    assert waited == []
    addr, timeout_s = manager.model_endpoint
    assert (addr, timeout_s) == ("127.0.0.1:18080", manager.config.gate_ready_timeout_s)
    for listen, out in ((addr, b"started"), ("127.0.0.1:18081", None)):
        argv = ["ca-launch", "--pidfile", "/home/agent/x.pid", "--await-listen", listen, "0.3", "--",
                "echo", "started"]
        proc = await manager.launch(sb, argv=argv, env={}, workdir="/home/agent", pidfile="/home/agent/x.pid")
        with anyio.fail_after(10):
            line = await proc.stream.receive()
            assert await proc.stream.receive() is None
        if out is not None:
            assert line == out
            assert await manager.engine.exec_exit_code(proc.stream.exec_id) == 0
        else:
            assert json.loads(line) == {"type": "launch_error", "reason": "model_gate_not_listening",
                                        "address": listen, "detail": f"nothing listened on {listen} within 0.3s"}
            assert await manager.engine.exec_exit_code(proc.stream.exec_id) == 3
    assert await manager.stop(user, chat)
    again = await manager.resolve(user, chat)
    manager.release(again)
    assert again.started and waited == [sb.container_id]


async def test_a_container_without_a_record_is_found_by_the_create_itself(manager: SandboxManager,
                                                                           docker_client, monkeypatch) -> None:
    """Issue 16: a new sandbox asked the engine for a container of its name before creating
    one. The create's own conflict says it now: a new sandbox's only inspect is the started
    container's, and a name taken by a container the store lost track of is still
    SANDBOX_UNRECORDED, with no volume left behind for it."""
    inspected: list[str] = []
    real_inspect = manager.engine.inspect

    async def inspect(ref: str):
        inspected.append(ref)
        return await real_inspect(ref)

    monkeypatch.setattr(manager.engine, "inspect", inspect)
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    manager.release(sb)
    assert inspected == [sb.container_id]
    user, chat = ids()
    name = container_name(user, chat)
    stray = docker_client.containers.create(manager.config.image, ["true"], name=name, network_mode="none")
    try:
        with pytest.raises(SandboxLost) as lost_:
            await manager.resolve(user, chat)
        assert (lost_.value.reason, lost_.value.detail) == (LostReason.SANDBOX_UNRECORDED,
                                                            f"{name} exists without a record")
        with pytest.raises(docker.errors.NotFound):
            docker_client.volumes.get(volume_name(name))
        assert docker_client.containers.get(name).id == stray.id  # not ours to remove
    finally:
        stray.remove(force=True)


async def lost(manager: SandboxManager, user: str, chat: str) -> tuple[LostReason, str]:
    with pytest.raises(SandboxLost) as err:
        await manager.resolve(user, chat)
    return err.value.reason, err.value.detail


async def test_container_removed_is_recreated_on_its_volume(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    manager.release(sb)
    code, _ = await manager.engine.exec_run(sb.container_id, ["sh", "-c", "echo kept > /home/agent/workspace/m"])
    assert code == 0
    docker_client.api.remove_container(sb.container_id, force=True)
    retired: list[str] = []
    again = await manager.resolve(user, chat, before_replace=lambda cid: _note(retired, cid))
    manager.release(again)
    assert (again.replaced, again.created, again.started) == (Replaced.RECREATED, False, True)
    assert again.container_id != sb.container_id and again.container.running
    assert again.record.container_name == sb.record.container_name  # the name is free again
    assert (again.volume, again.record.volume_id) == (sb.volume, sb.record.volume_id)
    assert retired == [sb.container_id]  # its residents are forgotten: they went with it
    rec = await manager.store.get_sandbox(user, chat)
    assert (rec.container_id, rec.state) == (again.container_id, SandboxState.RUNNING)
    code, out = await manager.engine.exec_run(again.container_id, ["cat", "/home/agent/workspace/m"])
    assert (code, out) == (0, b"kept\n")
    third = await manager.resolve(user, chat)  # nothing to replace now
    manager.release(third)
    assert (third.container_id, third.replaced) == (again.container_id, None)


async def _note(seen: list[str], container_id: str) -> None:
    seen.append(container_id)


async def test_lost_when_volume_removed(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    docker_client.api.remove_container(sb.container_id, force=True)
    docker_client.api.remove_volume(sb.volume)
    assert await lost(manager, user, chat) == (LostReason.VOLUME_MISSING, f"volume {sb.volume} is gone")
    # a LOST sandbox stays LOST: no quiet new volume, no new container
    assert (await lost(manager, user, chat))[0] == LostReason.PREVIOUSLY_LOST
    assert (await manager.store.get_sandbox(user, chat)).lost_reason == "volume_missing"
    assert docker_client.api.containers(all=True, filters={"name": sb.record.container_name}) == []
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_volume(sb.volume)


async def test_lost_when_the_record_names_another_chats_volume(manager: SandboxManager, docker_client) -> None:
    (ua, ca), (ub, cb) = ids(), ids()
    a, b = await manager.resolve(ua, ca), await manager.resolve(ub, cb)
    docker_client.api.remove_container(a.container_id, force=True)
    rec = await manager.store.get_sandbox(ua, ca)
    await manager.store.put_sandbox(rec.model_copy(update={"volume_name": b.volume, "volume_id": b.record.volume_id}))
    reason, detail = await lost(manager, ua, ca)
    assert reason == LostReason.VOLUME_MISMATCH
    assert detail == (f"volume {b.volume}: labels differ: org.cloud-agent.chat-digest, org.cloud-agent.identity, "
                      "org.cloud-agent.user-digest")
    assert docker_client.api.containers(all=True, filters={"name": a.record.container_name}) == []


async def test_lost_when_another_chats_content_carries_this_chats_name_and_labels(manager: SandboxManager,
                                                                                    docker_client) -> None:
    """Labels can be copied; the marker travels with the content: B's home under A's volume
    name with A's exact labels is caught by the marker, before the new container starts."""
    (ua, ca), (ub, cb) = ids(), ids()
    a, b = await manager.resolve(ua, ca), await manager.resolve(ub, cb)
    labels = docker_client.api.inspect_volume(a.volume)["Labels"]
    docker_client.api.remove_container(a.container_id, force=True)
    docker_client.api.remove_volume(a.volume)
    docker_client.api.create_volume(a.volume, labels=labels)
    carrier = docker_client.containers.create(a.image.id, command=["true"], network_mode="none",
                                              volumes={a.volume: {"bind": "/home/agent", "mode": "rw"}})
    try:
        bits, _ = docker_client.api.get_archive(b.container_id, "/home/agent")
        assert docker_client.api.put_archive(carrier.id, "/home", b"".join(bits))
    finally:
        carrier.remove(force=True)
    reason, detail = await lost(manager, ua, ca)
    assert (reason, detail) == (LostReason.VOLUME_MISMATCH, f"volume {a.volume}: the identity marker names another chat")
    # the container made on it was never started, and is gone again
    assert docker_client.api.containers(all=True, filters={"name": a.record.container_name}) == []


async def test_a_stopped_container_whose_marker_is_wrong_is_refused_and_left_stopped(manager: SandboxManager,
                                                                                     docker_client) -> None:
    """The marker is read while the container starts (issue 16); a wrong one stops it again
    before anything but its model gate ran, and nothing of the chat's is launched in it."""
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    manager.release(sb)
    assert await manager.stop(user, chat)
    await manager.engine.put_root_file(sb.container_id, MARKER_PATH, marker_bytes(digest("sandbox", user, chat),
                                                                                   "f" * 32))
    reason, detail = await lost(manager, user, chat)
    assert (reason, detail) == (LostReason.VOLUME_MISMATCH,
                                f"volume {sb.volume}: the identity marker names volume id ffffffffffff, not "
                                f"{sb.record.volume_id[:12]}")
    assert docker_client.api.inspect_container(sb.container_id)["State"]["Status"] == "exited"


async def test_upgrade_replaces_the_container_on_the_same_volume(manager: SandboxManager, docker_client,
                                                                 sandbox_image) -> None:
    """Another configured image → a container from it on the same volume, after the turns on
    the old one ended and its residents retired. The old image's pins no longer need to be
    supported (here the helper pin moves on): it never serves a turn, its volume is upgraded."""
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    code, _ = await manager.engine.exec_run(sb.container_id, ["sh", "-c", "echo kept > /home/agent/workspace/m"])
    assert code == 0
    pins = load_pins()
    newer = pins.model_copy(update={"helper": pins.helper.model_copy(update={"version": pins.helper.version + 1})})
    with relabelled_image(sandbox_image, **{pins.helper.name: str(newer.helper.version)}) as tag:
        manager.config = dataclasses.replace(manager.config, image=tag, pins=newer)
        retired: list[str] = []
        turn = anyio.Event()
        async with anyio.create_task_group() as tg:
            async def upgrade() -> None:
                up = await manager.resolve(user, chat, before_replace=lambda cid: _note(retired, cid))
                manager.release(up)
                result.append(up)
                turn.set()

            result: list[Sandbox] = []
            tg.start_soon(upgrade)
            with anyio.fail_after(30):  # it waits for the turn that still uses the old container
                while sb.container_id not in manager.uses._idle:
                    await anyio.sleep(0.01)
            assert retired == [] and not turn.is_set()
            assert docker_client.api.inspect_container(sb.container_id)["State"]["Running"]
            manager.release(sb)  # that turn ends
        up = result[0]
        assert retired == [sb.container_id]
        assert (up.replaced, up.replaced_image_id, up.image.id) == (Replaced.UPGRADED, sb.image.id,
                                                                   docker_client.images.get(tag).id)
        assert up.container.image_id == up.image.id and up.volume == sb.volume
        code, out = await manager.engine.exec_run(up.container_id, ["cat", "/home/agent/workspace/m"])
        assert (code, out) == (0, b"kept\n")
        with pytest.raises(docker.errors.NotFound):
            docker_client.api.inspect_container(sb.container_id)
        assert (await manager.store.get_sandbox(user, chat)).image_id == up.image.id
        docker_client.api.remove_container(up.container_id, force=True)  # before the image goes


async def test_a_legacy_sandbox_is_migrated_once(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    dirs = manager.member_dirs("m1")
    files = [FileEntry(f"{dirs.home}/.native/session.jsonl", b'{"turn": 1}\n', 0o600),
             FileEntry(f"{dirs.workspace}/notes.txt", b"workspace file\n")]
    old = await legacy_sandbox(manager, user, chat, files)
    # the native state is in its writable layer: nothing is mounted at the agent's home
    assert [m for m in docker_client.api.inspect_container(old.container_id)["Mounts"]
            if m["Destination"] == "/home/agent"] == []
    retired: list[str] = []
    sb = await manager.resolve(user, chat, before_replace=lambda cid: _note(retired, cid))
    manager.release(sb)
    assert (sb.replaced, sb.replaced_image_id, retired) == (Replaced.MIGRATED, old.image_id, [old.container_id])
    rec = await manager.store.get_sandbox(user, chat)
    assert (rec.container_id, rec.volume_name, rec.state) == (sb.container_id, volume_name(old.container_name),
                                                              SandboxState.RUNNING)
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(old.container_id)
    script = (f"stat -c '%U %a %s' {dirs.home}/.native/session.jsonl {dirs.workspace}/notes.txt; "
              f"stat -c '%U %a' {MARKER_PATH}; cat {dirs.home}/.native/session.jsonl {dirs.workspace}/notes.txt")
    code, out = await manager.engine.exec_run(sb.container_id, ["sh", "-c", script])
    assert (code, out.decode().splitlines()) == (0, ["agent 600 12", "agent 644 15", "root 444",
                                                    '{"turn": 1}', "workspace file"])
    assert json.loads(await manager.engine.read_file(sb.container_id, MARKER_PATH)) == \
        {"identity": digest("sandbox", user, chat), "volume_id": rec.volume_id}
    again = await manager.resolve(user, chat)  # once: from now on it is a volume sandbox
    manager.release(again)
    assert (again.container_id, again.replaced) == (sb.container_id, None)


async def test_an_interrupted_migration_is_redone(manager: SandboxManager, docker_client) -> None:
    """A move that stopped after making the volume and the new container: the old container
    is set aside (renamed), a partial volume and an unrecorded container of ours hold the
    chat's names. The next resolve removes both and moves the home again."""
    user, chat = ids()
    dirs = manager.member_dirs("m1")
    old = await legacy_sandbox(manager, user, chat, [FileEntry(f"{dirs.home}/state", b"whole\n")], running=False)
    docker_client.api.rename(old.container_id, f"{old.container_name}-premigration")
    vol = (await manager.new_volume(user, chat, old.data_root_id)).name
    partial = await manager.engine.create(manager.spec(user, chat, old.data_root_id,
                                                       await manager.engine.image(old.image_id), vol))
    sb = await manager.resolve(user, chat)
    manager.release(sb)
    assert sb.replaced == Replaced.MIGRATED and sb.container_id != partial.id
    code, out = await manager.engine.exec_run(sb.container_id, ["cat", f"{dirs.home}/state"])
    assert (code, out) == (0, b"whole\n")
    assert [c["Id"] for c in docker_client.api.containers(all=True, filters={"label": f"{LABEL_IDENTITY}="
                                                                              f"{digest('sandbox', user, chat)}"})] \
        == [sb.container_id]


async def test_a_legacy_sandbox_whose_container_is_gone_is_refused_with_the_reason(manager: SandboxManager,
                                                                                   docker_client) -> None:
    user, chat = ids()
    old = await legacy_sandbox(manager, user, chat)
    docker_client.api.remove_container(old.container_id, force=True)
    reason, detail = await lost(manager, user, chat)
    assert reason == LostReason.MIGRATION_IMPOSSIBLE
    assert detail == (f"container {old.container_name} is gone: it was made before state volumes and held the "
                      "native state itself, so there is nothing to move to a volume")
    with pytest.raises(docker.errors.NotFound):  # no volume was made up for it
        docker_client.api.inspect_volume(volume_name(old.container_name))


async def test_destroy_removes_container_and_volume(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    manager.release(sb)
    assert await manager.destroy(user, chat) is True
    # nothing of the chat stays in the manager's maps (a host deletes chats all day long)
    assert ((user, chat) in manager._chat_locks, sb.container_id in manager._marker_seen) == (False, False)
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(sb.container_id)
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_volume(sb.volume)
    assert await manager.destroy(user, chat) is False  # idempotent
    # the volume alone (chat deletion removes the container itself first)
    u2, c2 = ids()
    sb2 = await manager.resolve(u2, c2)
    manager.release(sb2)
    docker_client.api.remove_container(sb2.container_id, force=True)
    assert await manager.remove_volume(u2, c2) is True
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_volume(sb2.volume)
    assert await manager.remove_volume(u2, c2) is False


async def test_lost_when_labels_tampered(manager: SandboxManager, docker_client) -> None:
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    # Replace the container by one with the same name but other identity labels.
    docker_client.api.remove_container(sb.container_id, force=True)
    other = docker_client.containers.create(sb.image.id, name=sb.record.container_name, init=True,
                                            labels={LABEL_IDENTITY: "forged"}, network_mode="none")
    rec = await manager.store.get_sandbox(user, chat)
    await manager.store.put_sandbox(rec.model_copy(update={"container_id": other.id}))
    with pytest.raises(SandboxLost) as err:
        await manager.resolve(user, chat)
    assert err.value.reason == LostReason.LABELS_MISMATCH
    other.remove(force=True)


async def test_a_sandbox_from_before_sealing_is_resealed_on_its_volume(manager: SandboxManager,
                                                                      docker_client) -> None:
    # Sandboxes created before issue 12 ran `sleep infinity` without a model socket mount (with
    # host networking for a loopback gateway). Docker cannot add a mount or change the network
    # of an existing container; the native state is on the chat's volume (SPEC 15), so a sealed
    # container replaces it there (before state volumes this was LOST sandbox_not_sealed).
    user, chat = ids()
    sb = await manager.resolve(user, chat)
    manager.release(sb)
    code, _ = await manager.engine.exec_run(sb.container_id, ["sh", "-c", "echo kept > /home/agent/workspace/m"])
    assert code == 0
    labels = docker_client.api.inspect_container(sb.container_id)["Config"]["Labels"]
    docker_client.api.remove_container(sb.container_id, force=True)
    old = docker_client.containers.create(sb.image.id, ["sleep", "infinity"], name=sb.record.container_name,
                                          init=True, labels=labels, network_mode="none", user="agent",
                                          volumes={sb.volume: {"bind": "/home/agent", "mode": "rw"}})
    rec = await manager.store.get_sandbox(user, chat)
    await manager.store.put_sandbox(rec.model_copy(update={"container_id": old.id}))
    info = await manager.engine.inspect(old.id)
    assert manager.unsealed(rec, info) == (f"no read-only model socket mount of {manager.socket_dir(user, chat)} "
                                           "at /run/cloud-agent/model")
    retired: list[str] = []
    new = await manager.resolve(user, chat, before_replace=lambda cid: _note(retired, cid))
    manager.release(new)
    assert (new.replaced, retired, new.volume) == (Replaced.RESEALED, [old.id], sb.volume)
    attrs = docker_client.api.inspect_container(new.container_id)
    assert attrs["HostConfig"]["NetworkMode"] == "none"
    assert [(m["Source"], m["RW"]) for m in attrs["Mounts"] if m["Destination"] == "/run/cloud-agent/model"] == [
        (str(manager.socket_dir(user, chat)), False)]
    assert manager.unsealed(rec, new.container) is None
    code, out = await manager.engine.exec_run(new.container_id, ["cat", "/home/agent/workspace/m"])
    assert (code, out) == (0, b"kept\n")
    with pytest.raises(docker.errors.NotFound):
        docker_client.api.inspect_container(old.id)
    # the host-networked variant, judged from its inspect document (never run here)
    host_net = ContainerInfo(id="x", name="n", status="exited", image_id="i", labels={},
                             attrs={"HostConfig": {"NetworkMode": "host"}, "Mounts": []})
    assert manager.unsealed(rec, host_net) == "created with network 'host'"


async def test_lost_when_data_root_identity_changes(manager: SandboxManager) -> None:
    user, chat = ids()
    await manager.resolve(user, chat)
    rec = await manager.store.get_sandbox(user, chat)
    await manager.store.put_sandbox(rec.model_copy(update={"data_root_id": "another-data-root"}))
    with pytest.raises(SandboxLost) as err:
        await manager.resolve(user, chat)
    assert err.value.reason == LostReason.DATA_ROOT_CHANGED
