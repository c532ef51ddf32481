"""ca-keeper in a real sandbox (pinned image, network none, init) through attached execs."""

from __future__ import annotations

import json
import os
import signal
import sys
import uuid

import anyio
import pytest

from sandbox_manager import keeper_sandbox
from sandbox_manager.engine import DockerEngine, FileEntry
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_errors import KeeperIdentityMismatch, KeeperUnavailable
from sandbox_manager.keeper_link import NoDirectLink, SocketBytes, connect_in_sandbox
from sandbox_manager.keeper_sandbox import KeeperPaths, run_prefix
from tests.support.keeper_local import FAKE_CLI, ROOT
from tests.support.throwaway_container import throwaway_container

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

FAKE_IN_SANDBOX = "/home/agent/keeper-test/fake_cli.py"


@pytest.fixture(scope="module")
def sandbox(sandbox_image, docker_client):
    with throwaway_container(sandbox_image, docker_client, prefix="ca-keeper-test") as cid:
        engine = DockerEngine()
        try:
            anyio.run(engine.put_files, cid, [FileEntry(FAKE_IN_SANDBOX, FAKE_CLI.read_bytes())], [])
        finally:
            engine.close()
        yield cid


@pytest.fixture
async def engine():
    e = DockerEngine()
    yield e
    e.close()


def member_paths() -> KeeperPaths:
    return KeeperPaths.in_run_dir(f"/home/agent/members/{uuid.uuid4().hex[:12]}/run")


def fake_argv(paths: KeeperPaths, *, member: str = "m1", launch_opts: tuple[str, ...] = ()) -> list[str]:
    return [*run_prefix(paths, member=member, tags={"locator": "loc-1"}), "--pidfile", paths.cli_pidfile,
            "--cwd", "/home/agent/workspace", *launch_opts, "--", "python3", "-I", "-S", FAKE_IN_SANDBOX]


async def procs(engine: DockerEngine, cid: str) -> list[dict[str, str]]:
    code, out = await engine.exec_run(cid, ["ps", "-eo", "pid=,pgid=,stat=,args="])
    rows = []
    for line in out.decode().splitlines():
        pid, pgid, st, args = line.split(None, 3)
        rows.append({"pid": pid, "pgid": pgid, "stat": st, "args": args})
    return rows


def subcommand(args: str) -> str:
    words = args.split()
    return next(words[i + 1] for i, w in enumerate(words) if w.endswith("/ca-keeper"))


def alive(rows: list[dict[str, str]], pid: int) -> bool:
    return any(r["pid"] == str(pid) and not r["stat"].startswith("Z") for r in rows)


async def read_until(ch: KeeperChannel, pred) -> list[bytes]:
    out = []
    while True:
        line = await ch.receive()
        assert line is not None, ch.diagnostics()
        out.append(line)
        if pred(line):
            return out


async def test_keeper_outlives_its_exec_and_replays_from_the_ack(engine, sandbox) -> None:
    paths = member_paths()
    with anyio.fail_after(90):
        ch = await keeper_sandbox.start(engine, sandbox, fake_argv(paths), env={"CLI_ENV_X": "plain-v"})
        ident = ch.identity
        assert json.loads(await ch.receive()) == {"ready": ident.pid}
        assert (ident.member, ident.tags) == ("m1", {"locator": "loc-1"})
        code, out = await engine.exec_run(sandbox, ["stat", "-c", "%a %U %F", paths.socket])
        assert (code, out.decode().strip()) == (0, "600 agent socket")
        await ch.send(b'{"op":"env","name":"CLI_ENV_X"}')
        assert json.loads(await ch.receive()) == {"env": "CLI_ENV_X", "value": "plain-v"}
        await ch.ack()
        await ch.send(b'{"op":"emit","n":20000,"size":50,"tag":"e"}')
        seen, offsets = [], []
        while len(seen) < 5000:
            seen.append(json.loads(await ch.receive())["seq"])
            offsets.append(ch.offset)
        assert seen == list(range(5000))
        # commit the first 2500 lines, then the exec goes away with no goodbye
        await ch.ack(offsets[2499])
        acked = ch.acked
        await anyio.sleep(0.2)
        await ch.stream.exec.aclose()  # type: ignore[attr-defined]
        rows = await procs(engine, sandbox)
        assert alive(rows, ident.pid) and alive(rows, ch.hello.keeper_pid), rows
        again = await keeper_sandbox.attach(engine, sandbox, paths, from_offset=acked, expect=ident)
        assert again.hello.keeper_id == ident.keeper_id and again.hello.acked == acked
        got = [json.loads(x)["seq"] for x in await read_until(again, lambda x: b'"seq": 19999,' in x)]
        assert got == list(range(2500, 20000))
        # the superseded exec's client is gone; the keeper, the CLI and the new client remain
        await anyio.sleep(0.5)
        keepers = [r for r in await procs(engine, sandbox) if "ca-keeper" in r["args"] and paths.socket in r["args"]
                   and not r["stat"].startswith("Z")]
        assert sorted(subcommand(r["args"]) for r in keepers) == ["attach", "run"], keepers
        status = await keeper_sandbox.status(engine, sandbox, paths)
        assert status is not None and status.hello.keeper_id == ident.keeper_id and status.hello.written > acked
        await keeper_sandbox.retire(engine, sandbox, paths)
        rows = await procs(engine, sandbox)
        assert not [r for r in rows if r["pgid"] in (str(ident.pid), str(ch.hello.keeper_pid))], rows
        assert not [r for r in rows if r["stat"].startswith("Z")], "init=True reaps the retired processes"
        assert await keeper_sandbox.status(engine, sandbox, paths) is None
        await again.detach()


async def test_daemon_killed_9_keeper_and_cli_survive_and_nothing_is_lost(engine, sandbox) -> None:
    paths = member_paths()
    with anyio.fail_after(120):
        daemon = await anyio.open_process(
            [sys.executable, "-m", "tests.support.keeper_docker_client", sandbox, json.dumps(fake_argv(paths)),
             "4000", "1500"], cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)})
        try:
            assert daemon.stdout is not None
            report = json.loads((await daemon.stdout.receive()).split(b"\n")[0])
            await anyio.sleep(0.3)
            daemon.send_signal(signal.SIGKILL)
            await daemon.wait()
        finally:
            if daemon.returncode is None:
                daemon.kill()
            await daemon.aclose()
        assert daemon.returncode == -signal.SIGKILL
        ident = keeper_sandbox.KeeperIdentity.model_validate(report["identity"])
        rows = await procs(engine, sandbox)
        assert alive(rows, ident.pid), rows
        ch = await keeper_sandbox.attach(engine, sandbox, paths, from_offset=report["acked"], expect=ident)
        got = [json.loads(x)["seq"] for x in await read_until(ch, lambda x: b'"seq": 19999,' in x)]
        assert got == list(range(1500, 20000))
        await ch.shutdown(grace_s=1.0)
        assert ch.exit is not None and ch.exit.signal == signal.SIGTERM
        rows = await procs(engine, sandbox)
        assert not [r for r in rows if r["pgid"] == str(ident.pid)], rows


async def test_forged_identity_dead_keeper_and_failed_precheck(engine, sandbox) -> None:
    paths = member_paths()
    with anyio.fail_after(90):
        ch = await keeper_sandbox.start(engine, sandbox, fake_argv(paths))
        ident = ch.identity
        await ch.receive()
        await ch.detach()
        forged = ident.model_copy(update={"keeper_id": "f" * 32})
        with pytest.raises(KeeperIdentityMismatch, match="keeper_id"):
            await keeper_sandbox.attach(engine, sandbox, paths, from_offset=0, expect=forged)
        code, out = await engine.exec_run(sandbox, ["cat", paths.pidfile])
        await engine.exec_run(sandbox, ["kill", "-KILL", out.decode().strip()])
        with pytest.raises(KeeperUnavailable, match="nothing answers on") as err:
            await keeper_sandbox.attach(engine, sandbox, paths, from_offset=0, expect=ident)
        assert err.value.reason == "no_keeper"
        await keeper_sandbox.retire(engine, sandbox, paths)
        rows = await procs(engine, sandbox)
        assert not [r for r in rows if r["pgid"] == str(ident.pid)], rows

        missing = "/home/agent/members/nope/session.jsonl"
        paths = member_paths()
        ch = await keeper_sandbox.start(engine, sandbox, fake_argv(paths, launch_opts=("--require-file", missing)))
        assert json.loads(await ch.receive()) == {"type": "launch_error", "reason": "missing_file", "path": missing}
        assert await ch.receive() is None
        assert (await ch.wait_exit()).code == 3
        await ch.ack()
        with anyio.fail_after(10):
            while await keeper_sandbox.status(engine, sandbox, paths) is not None:
                await anyio.sleep(0.1)
        await ch.detach()


@pytest.mark.cli
async def test_real_codex_app_server_read_back_across_a_reattach(engine, sandbox) -> None:
    """The pinned Codex under a keeper: its initialize answer is replayed byte for byte after
    the exec dies, and a reply it writes while nobody is attached reaches the next attach."""
    paths = member_paths()
    home = paths.socket.rsplit("/run/", 1)[0] + "/home"
    await engine.put_files(sandbox, [], [f"{home}/codex"])
    argv = [*run_prefix(paths, member="codex-m", tags={"locator": "thread-none"}), "--pidfile", paths.cli_pidfile,
            "--cwd", "/home/agent/workspace", "--", "codex-native", "app-server"]
    with anyio.fail_after(120):
        ch = await keeper_sandbox.start(engine, sandbox, argv, env={"CODEX_HOME": f"{home}/codex", "HOME": home})
        ident = ch.identity
        await ch.send(b'{"method":"initialize","id":0,"params":{"clientInfo":{"name":"keeper","title":"k",'
                      b'"version":"0.0.1"}}}')
        before = ch.offset
        lines = await read_until(ch, lambda x: json.loads(x).get("id") == 0)
        answer = lines[-1]
        assert "0.171.0" in json.loads(answer)["result"]["userAgent"]
        await ch.ack(before)  # not the answer itself: it must come again
        await ch.stream.exec.aclose()  # type: ignore[attr-defined]

        ch = await keeper_sandbox.attach(engine, sandbox, paths, from_offset=before, expect=ident)
        assert (await read_until(ch, lambda x: json.loads(x).get("id") == 0))[-1] == answer
        await ch.ack()
        await ch.send(b'{"method":"initialized"}')
        await ch.send(b'{"method":"no/such/method","id":1,"params":{}}')
        await anyio.sleep(1.0)
        await ch.stream.exec.aclose()  # type: ignore[attr-defined]  # the reply lands while detached

        ch = await keeper_sandbox.attach(engine, sandbox, paths, from_offset=ch.acked, expect=ident)
        reply = json.loads((await read_until(ch, lambda x: json.loads(x).get("id") == 1))[-1])
        assert reply["error"]["code"] == -32600 and "unknown variant" in reply["error"]["message"]
        assert ch.hello.pid == ident.pid and ch.alive
        await ch.shutdown(grace_s=2.0)
        rows = await procs(engine, sandbox)
        assert not [r for r in rows if r["pgid"] == str(ident.pid)], rows


@pytest.mark.cli
async def test_real_pi_rpc_get_state_read_back_across_a_reattach(engine, sandbox) -> None:
    """The pinned pi under a keeper: its get_state answer, produced while nobody is attached,
    arrives whole on the next attach; the one before is replayed byte for byte."""
    paths = member_paths()
    home = paths.socket.rsplit("/run/", 1)[0] + "/home"
    await engine.put_files(sandbox, [], [f"{home}/.pi/agent"])
    argv = [*run_prefix(paths, member="pi-m", tags={"locator": "none"}), "--pidfile", paths.cli_pidfile,
            "--cwd", "/home/agent/workspace", "--", "pi", "--mode", "rpc", "--no-extensions", "--no-skills",
            "--no-prompt-templates", "--no-context-files", "--no-themes", "--no-session"]
    env = {"HOME": home, "PI_CODING_AGENT_DIR": f"{home}/.pi/agent", "PI_OFFLINE": "1", "PI_SKIP_VERSION_CHECK": "1",
           "PI_TELEMETRY": "0"}

    def is_state(n: str):
        return lambda x: json.loads(x).get("id") == n and json.loads(x).get("command") == "get_state"

    with anyio.fail_after(120):
        ch = await keeper_sandbox.start(engine, sandbox, argv, env=env)
        ident = ch.identity
        await ch.send(b'{"id":"s1","type":"get_state"}')
        before = ch.offset
        lines = await read_until(ch, is_state("s1"))
        assert json.loads(lines[-1])["success"] is True
        await ch.ack(before)
        await ch.send(b'{"id":"s2","type":"get_state"}')
        await anyio.sleep(1.0)
        await ch.stream.exec.aclose()  # type: ignore[attr-defined]  # s2's answer lands while detached

        ch = await keeper_sandbox.attach(engine, sandbox, paths, from_offset=before, expect=ident)
        replayed = await read_until(ch, is_state("s2"))
        assert replayed[:len(lines)] == lines  # from the acknowledged offset: the same bytes again
        second = json.loads(replayed[-1])
        assert second["success"] is True and second["data"]["isStreaming"] is False
        assert ch.hello.pid == ident.pid and ch.alive
        await ch.shutdown(grace_s=2.0)
        rows = await procs(engine, sandbox)
        assert not [r for r in rows if r["pgid"] == str(ident.pid)], rows


async def test_a_keeper_is_linked_from_the_host_and_its_relay_ends(engine, sandbox) -> None:
    """After the start, the keeper's socket from the host (sandbox_manager.keeper_link): the
    start's exec (its relay) ends, and the CLI's lines come through the socket."""
    paths = member_paths()
    with anyio.fail_after(90):
        started = await keeper_sandbox.start(engine, sandbox, fake_argv(paths))
        init_pid = (await engine.inspect(sandbox)).attrs["State"]["Pid"]
        ch = await keeper_sandbox.go_direct(started, init_pid, paths)
        assert isinstance(ch.stream, SocketBytes)
        assert json.loads(await ch.receive()) == {"ready": ch.identity.pid}
        await ch.send(b'{"op":"env","name":"HOME"}')
        assert json.loads(await ch.receive()) == {"env": "HOME", "value": "/home/agent"}
        keeper_pid = str(ch.hello.keeper_pid)
        while True:  # the start's own process (the relay) ends once its exec is closed
            on_socket = [r for r in await procs(engine, sandbox) if paths.socket in r["args"]
                         and not r["stat"].startswith("Z")]
            if [r["pid"] for r in on_socket] == [keeper_pid]:
                break
            await anyio.sleep(0.1)
        await ch.shutdown()


async def test_a_socket_path_pointing_out_of_the_sandbox_is_never_linked(engine, sandbox) -> None:
    """The sandbox owns its run dir: a symlink in the keeper socket's place naming the engine's
    socket would, read from the host through /proc/<pid>/root, reach the host's engine. The
    peer is outside the sandbox's pid namespace: refused before a byte is sent, and the attach
    falls back to an exec, which resolves the path inside the sandbox (no such socket there)."""
    paths = member_paths()
    with anyio.fail_after(90):
        started = await keeper_sandbox.start(engine, sandbox, fake_argv(paths))
        identity = started.identity
        init_pid = (await engine.inspect(sandbox)).attrs["State"]["Pid"]
        await started.detach()
        code, out = await engine.exec_run(sandbox, ["ln", "-sfn", "/var/run/docker.sock", paths.socket])
        assert code == 0, out
        assert os.path.exists("/var/run/docker.sock")  # the host's engine answers there
        with pytest.raises(NoDirectLink, match="outside the sandbox's pid namespace"):
            await anyio.to_thread.run_sync(connect_in_sandbox, init_pid, paths.socket)
        with pytest.raises(KeeperUnavailable):
            await keeper_sandbox.attach(engine, sandbox, paths, from_offset=0, expect=identity, init_pid=init_pid)
        await keeper_sandbox.retire(engine, sandbox, paths)
