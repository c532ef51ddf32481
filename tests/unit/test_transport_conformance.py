"""The transport contract (drivers/transport.py), run against every transport a driver meets.

* ``local``: :class:`tests.support.local_process.LocalProcessTransport` (the driver tests' transport);
* ``exec``: an attached ``docker exec`` in a real container, as the runner hands it to a driver
  (marker ``docker``);
* ``keeper`` / ``keeper-exec``: a :class:`~sandbox_manager.keeper.KeeperChannel` to the peer run
  under ``ca-keeper``, as a local process and in a real container (marker ``docker``), behind
  the same runner adapter as the exec stream;
* ``codex-replay`` / ``pi-replay`` / ``claude-replay``: the recorded-stream replays of tests/support.

Every case is one scenario: the test sends *commands*; the peer answers with the lines (and the
unterminated tail) the command names, and may exit. A live peer is a small python program run
through the in-sandbox launcher; a replay plays the same scenario from a recording. The contract:
EOF is ``None`` (idempotent) and ``alive`` turns false; an unterminated last line still arrives;
a line over the bound raises :class:`~drivers.transport.LineTooLong`; after ``close()`` a send
raises :class:`~drivers.transport.TransportClosed` while output still drains; a cancelled
``receive`` loses nothing. Only errors of the transport family (and cancellation) ever escape.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from drivers.launch import LaunchSpec
from drivers.transport import LineTooLong, Transport, TransportClosed, TransportError
from tests.support.claude_replay import ScriptedTransport as ClaudeReplay
from tests.support.codex_replay import ReplayTransport as CodexReplay
from tests.support.local_process import LocalProcessTransport
from tests.support.pi_replay import ScriptedPiTransport as PiReplay

pytestmark = pytest.mark.anyio

LIMIT = 4096  # the line bound the transports under test are given (production: 32 MiB)

# The live peer: one JSON command per stdin line; it prints the command's ``out`` lines, then its
# ``tail`` without a newline, and exits when ``exit`` is set. On stdin EOF it prints "bye" and exits.
PEER = r"""
import json, sys
out = sys.stdout.buffer
for raw in sys.stdin.buffer:
    cmd = json.loads(raw)
    for line in cmd.get("out", []):
        out.write(line.encode() + b"\n")
    if cmd.get("tail"):
        out.write(cmd["tail"].encode())
    out.flush()
    if cmd.get("exit"):
        sys.exit(0)
out.write(b"bye\n")
out.flush()
"""


def command(n: int, *, out: list[str] = (), tail: str = "", exit: bool = False) -> dict[str, Any]:
    # method + id + type: each replay matches a command its own way (Codex by id and method,
    # pi by type, Claude by order), so one command shape serves all of them.
    return {"id": n, "method": "say", "type": "say", "out": list(out), "tail": tail, "exit": exit}


def response(n: int) -> str:
    """A line that answers command ``n`` (the Codex replay holds it until the command is sent)."""
    return json.dumps({"id": n, "result": {"said": n}})


@dataclass
class Scenario:
    commands: list[dict[str, Any]] = field(default_factory=list)
    on_close: list[str] = field(default_factory=list)  # what the peer prints after stdin EOF


Factory = Callable[[Scenario], Awaitable[Transport]]


# ---------------------------------------------------------------- replays of a scenario


def _replay_lines(sc: Scenario) -> tuple[list[tuple[str, bytes]], bool]:
    """(``(direction, line)`` steps with ``send``/``recv`` directions, ends-with-EOF)."""
    steps: list[tuple[str, bytes]] = []
    ended = False
    for cmd in sc.commands:
        steps.append(("send", json.dumps(cmd).encode()))
        steps += [("recv", line.encode()) for line in cmd["out"]]
        if cmd["tail"]:
            steps.append(("recv", cmd["tail"].encode()))
        if cmd["exit"]:
            ended = True
            break
    if not ended and sc.on_close:
        steps += [("recv", line.encode()) for line in sc.on_close]
        ended = True
    return steps, ended


async def codex_replay(sc: Scenario) -> Transport:
    steps, ended = _replay_lines(sc)
    return CodexReplay(steps, at_end="eof" if ended else "hang", max_line=LIMIT)


async def pi_replay(sc: Scenario) -> Transport:
    steps, ended = _replay_lines(sc)
    return PiReplay([("in" if d == "send" else "out", line) for d, line in steps], hold_open=not ended,
                    max_line=LIMIT)


async def claude_replay(sc: Scenario) -> Transport:
    steps, ended = _replay_lines(sc)
    return ClaudeReplay([(d, json.loads(line) if d == "send" else line) for d, line in steps], hold_open=not ended,
                        max_line=LIMIT)


# ---------------------------------------------------------------- live peers


def peer_spec(cwd: str) -> LaunchSpec:
    return LaunchSpec(runtime="peer", argv=["python3", "-u", "-c", PEER], cwd=cwd)


@pytest.fixture
async def local(tmp_path) -> AsyncIterator[Factory]:
    started: list[LocalProcessTransport] = []

    async def make(_: Scenario) -> Transport:
        t = await LocalProcessTransport.start(peer_spec(str(tmp_path)), run_dir=tmp_path / f"run-{len(started)}",
                                              max_line=LIMIT)
        started.append(t)
        return t

    yield make
    for t in started:
        with anyio.CancelScope(shield=True):
            await t.kill()


@pytest.fixture(scope="module")
def peer_container(docker_client, sandbox_image):
    c = docker_client.containers.run(sandbox_image, ["sleep", "infinity"], detach=True, init=True,
                                     network_mode="none", user="agent",
                                     labels={"cloud-agent.test": "transport-conformance"})
    yield c
    c.remove(force=True)


@pytest.fixture
async def exec_stream(peer_container) -> AsyncIterator[Factory]:
    from runner.transport import exec_transport
    from sandbox_manager.engine import DockerEngine

    engine = DockerEngine()
    streams: list[Any] = []

    async def make(_: Scenario) -> Transport:
        pidfile = f"/tmp/peer-{uuid.uuid4().hex[:8]}.pid"
        argv = peer_spec("/tmp").launcher_argv(pidfile=pidfile)
        stream = await engine.exec_attached(peer_container.id, argv, workdir="/tmp")
        stream.max_line = LIMIT
        streams.append(stream)
        return exec_transport(stream)

    yield make
    for s in streams:
        with anyio.CancelScope(shield=True):
            await s.aclose()
    engine.close()


def keeper_argv(paths: Any, cwd: str, keeper: tuple[str, ...] | None = None) -> list[str]:
    from sandbox_manager.keeper_sandbox import run_prefix

    prefix = run_prefix(paths, member="peer", keeper=keeper) if keeper else run_prefix(paths, member="peer")
    return [*prefix, "--pidfile", paths.cli_pidfile, "--cwd", cwd, "--", "python3", "-u", "-c", PEER]


@pytest.fixture
async def keeper(tmp_path) -> AsyncIterator[Factory]:
    from runner.transport import exec_transport
    from sandbox_manager.keeper import KeeperChannel
    from tests.support.keeper_local import ProcessBytes
    from sandbox_manager.keeper_sandbox import KeeperPaths, retire_argv
    from tests.support.keeper_local import keeper_cmd, open_client, reap

    started: list[Any] = []

    async def make(_: Scenario) -> Transport:
        paths = KeeperPaths.in_run_dir(str(tmp_path / f"keeper-{len(started)}"))
        client = await open_client(keeper_argv(paths, str(tmp_path), keeper_cmd()))
        started.append((paths, client))
        channel = await KeeperChannel.open(ProcessBytes(client), timeout_s=20, max_line=LIMIT)
        return exec_transport(channel)  # type: ignore[arg-type]  # the same stream surface

    yield make
    for paths, client in started:
        with anyio.CancelScope(shield=True):
            await reap(client)
            await anyio.run_process(retire_argv(paths, grace_s=1.0), check=False)


@pytest.fixture
async def keeper_exec(peer_container) -> AsyncIterator[Factory]:
    from runner.transport import exec_transport
    from sandbox_manager import keeper_sandbox
    from sandbox_manager.engine import DockerEngine
    from sandbox_manager.keeper_sandbox import KeeperPaths

    engine = DockerEngine()
    started: list[Any] = []

    async def make(_: Scenario) -> Transport:
        paths = KeeperPaths.in_run_dir(f"/tmp/keeper-{uuid.uuid4().hex[:8]}")
        channel = await keeper_sandbox.start(engine, peer_container.id, keeper_argv(paths, "/tmp"), workdir="/tmp")
        channel.max_line = LIMIT
        started.append((paths, channel))
        return exec_transport(channel)  # type: ignore[arg-type]

    yield make
    for paths, channel in started:
        with anyio.CancelScope(shield=True):
            await channel.detach()
            await keeper_sandbox.retire(engine, peer_container.id, paths, grace_s=1.0)
    engine.close()


EXEC = pytest.param("exec", marks=pytest.mark.docker)
KEEPER_EXEC = pytest.param("keeper-exec", marks=pytest.mark.docker)
LIVE = {"local": "local", "exec": "exec_stream", "keeper": "keeper", "keeper-exec": "keeper_exec"}
REPLAYS: dict[str, Factory] = {"codex-replay": codex_replay, "pi-replay": pi_replay, "claude-replay": claude_replay}


@pytest.fixture(params=["local", EXEC, "keeper", KEEPER_EXEC, *REPLAYS])
def make(request) -> Factory:
    if request.param in REPLAYS:
        return REPLAYS[request.param]
    return request.getfixturevalue(LIVE[request.param])


@pytest.fixture(params=["local", EXEC, "keeper", KEEPER_EXEC])
def live(request) -> Factory:
    return request.getfixturevalue(LIVE[request.param])


async def send(t: Transport, cmd: dict[str, Any]) -> None:
    await t.send(json.dumps(cmd).encode())


async def drain(t: Transport) -> list[bytes]:
    lines = []
    while (line := await t.receive()) is not None:
        lines.append(line)
    return lines


# ---------------------------------------------------------------- the cases


async def test_lines_round_trip_then_eof(make: Factory) -> None:
    cmds = [command(1, out=[response(1), '{"text": "\u4e16\u754c \U0001f600"}']), command(2, out=["last"], exit=True)]
    t = await make(Scenario(cmds))
    with anyio.fail_after(30):
        await send(t, cmds[0])
        assert await t.receive() == response(1).encode()
        assert await t.receive() == '{"text": "\u4e16\u754c \U0001f600"}'.encode()
        await send(t, cmds[1])
        assert await t.receive() == b"last"
        assert await t.receive() is None
        assert await t.receive() is None  # EOF is idempotent
    assert not t.alive
    assert isinstance(t.diagnostics(), str)


async def test_close_mid_line_delivers_the_tail_then_eof(make: Factory) -> None:
    cmds = [command(1, out=["whole"], tail='{"cut": "mid', exit=True)]
    t = await make(Scenario(cmds))
    with anyio.fail_after(30):
        await send(t, cmds[0])
        assert await drain(t) == [b"whole", b'{"cut": "mid']
        assert await t.receive() is None
    assert not t.alive


async def test_oversize_line_raises_line_too_long(make: Factory) -> None:
    cmds = [command(1, out=["before", "x" * (LIMIT + 1), "after"])]
    t = await make(Scenario(cmds))
    with anyio.fail_after(30):
        await send(t, cmds[0])
        assert await t.receive() == b"before"
        with pytest.raises(LineTooLong) as caught:
            await t.receive()
    assert isinstance(caught.value, TransportClosed)  # drivers treat it as a dead stream
    assert not t.alive


async def test_write_after_close_raises_and_output_still_drains(make: Factory) -> None:
    cmds = [command(1, out=[response(1)])]
    t = await make(Scenario(cmds, on_close=["bye"]))
    with anyio.fail_after(30):
        await send(t, cmds[0])
        assert await t.receive() == response(1).encode()
        await t.close()
        await t.close()  # idempotent
        assert not t.alive
        with pytest.raises(TransportClosed):
            await send(t, command(2))
        assert await drain(t) == [b"bye"]  # a half-close: the peer's last words still arrive


async def test_cancelled_receive_loses_nothing(make: Factory) -> None:
    cmds = [command(1, out=[response(1)]), command(2, out=[response(2)])]
    t = await make(Scenario(cmds))
    with anyio.fail_after(30):
        for cmd in cmds:
            with anyio.move_on_after(0.3) as idle:
                await t.receive()  # nothing was asked yet: it waits, and is cancelled
            assert idle.cancelled_caught
            await send(t, cmd)
            assert await t.receive() == response(cmd["id"]).encode()
    assert t.alive


async def test_cancelled_receive_mid_line_keeps_the_partial_line(live: Factory) -> None:
    """Live streams only: a replay delivers recorded lines whole, so it has no half line."""
    cmds = [command(1, out=[response(1)], tail='{"par'), command(2, out=['tial": 2}', response(2)])]
    t = await live(Scenario(cmds))
    with anyio.fail_after(30):
        await send(t, cmds[0])
        assert await t.receive() == response(1).encode()
        with anyio.move_on_after(0.3) as mid_line:
            await t.receive()  # half a line has arrived; the rest has not
        assert mid_line.cancelled_caught
        await send(t, cmds[1])
        assert await t.receive() == b'{"partial": 2}'
        assert await t.receive() == response(2).encode()
    assert t.alive


async def test_only_transport_errors_escape(make: Factory) -> None:
    """After the peer is gone, every call either works or raises the transport family."""
    cmds = [command(1, exit=True)]
    t = await make(Scenario(cmds))
    with anyio.fail_after(30):
        await send(t, cmds[0])
        assert await drain(t) == []
        for _ in range(3):
            try:
                await send(t, command(2))
            except TransportError:
                pass
        await t.close()
        with pytest.raises(TransportClosed):
            await send(t, command(3))
        assert await t.receive() is None
