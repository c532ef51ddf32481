"""The link to a keeper's socket from the host (sandbox_manager.keeper_link), with real local
keepers (host python3). Locally the "sandbox's init" is this process (its /proc root is /), or,
for the namespace checks, a process ``unshare`` put in a pid namespace of its own."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from contextlib import asynccontextmanager
from pathlib import Path
from types import SimpleNamespace

import anyio
import pytest
from pydantic import ValidationError

from runner.config import load_settings
from runner.keepers import Keepers
from sandbox_manager import keeper_sandbox
from sandbox_manager.engine import NotFound
from sandbox_manager.keeper_errors import KeeperIdentityMismatch, KeeperUnavailable
from sandbox_manager.keeper_identity import KeeperIdentity
from sandbox_manager.keeper_link import (
    NoDirectLink,
    SocketBytes,
    connect_in_sandbox,
    link_direct,
)
from sandbox_manager.keeper_sandbox import KeeperPaths, retire_argv
from state.keepers import KeeperRecord
from tests.support.keeper_local import fake_cli_argv, reap, start_local

pytestmark = pytest.mark.anyio

ECHO = b'{"op":"echo","payload":"through the socket"}'


@pytest.fixture
def paths(tmp_path):
    p = KeeperPaths.in_run_dir(str(tmp_path / "run"))
    yield p
    subprocess.run(retire_argv(p, grace_s=1.0), check=False, timeout=30)


class NoEngine:
    """An attach that needs no exec must not touch the engine."""

    def __getattr__(self, name: str):
        raise AssertionError(f"the engine was used: {name}")


async def test_a_started_keeper_goes_direct_and_its_relay_ends(paths) -> None:
    channel, client = await start_local(paths, fake_cli_argv())
    direct = await keeper_sandbox.go_direct(channel, os.getpid(), paths)
    assert isinstance(direct.stream, SocketBytes)
    assert direct.identity == channel.identity
    # nothing the CLI wrote before the switch is lost: its first line comes on the new link
    assert json.loads(await direct.receive())["ready"] > 0
    await direct.send(ECHO)
    assert await direct.receive() == ECHO
    with anyio.fail_after(10):
        await client.wait()  # the start's client (the relay) was superseded and ended
    await direct.shutdown()


async def test_closing_the_link_ends_a_read_in_flight(paths) -> None:
    """A retire closes the link under the turn that is reading it (a disk bound's stop): the
    read ends at once instead of waiting on a socket nobody watches any more."""
    channel, client = await start_local(paths, fake_cli_argv())
    direct = await keeper_sandbox.go_direct(channel, os.getpid(), paths)
    await direct.receive()  # ready; the CLI says nothing more unless asked
    ended: list[str] = []

    async def read() -> None:
        try:
            ended.append(repr(await direct.receive()))
        except Exception as exc:  # noqa: BLE001 - which end it is, is asserted below
            ended.append(type(exc).__name__)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.2)
            assert ended == []
            await direct.detach()
    assert ended in (["None"], ["KeeperDetached"]), ended
    await reap(client)


async def test_no_socket_or_no_pid_is_no_link(paths, tmp_path) -> None:
    channel, client = await start_local(paths, fake_cli_argv())
    try:
        gone = str(tmp_path / "run" / "nobody.sock")
        assert await link_direct(os.getpid(), gone, expect=channel.identity, from_offset=0) is None
        assert await link_direct(None, paths.socket, expect=channel.identity, from_offset=0) is None
        with pytest.raises(NoDirectLink, match="nobody.sock"):
            connect_in_sandbox(os.getpid(), gone)
        # the start's link is still the one in use: nothing was superseded
        await channel.send(ECHO)
        assert json.loads(await channel.receive())["ready"] > 0
        assert await channel.receive() == ECHO
    finally:
        await channel.detach()
        await reap(client)


async def test_a_socket_that_closes_before_a_hello_is_no_link(tmp_path) -> None:
    """A keeper ending as its CLI failed to start closes its clients: the caller's own link
    (the start's exec) says what happened, so the host's link is given up, not raised."""
    path = str(tmp_path / "keeper.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    server.settimeout(10)

    def close_one() -> None:
        conn, _ = server.accept()
        conn.close()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(anyio.to_thread.run_sync, close_one)
            identity = KeeperIdentity(keeper_id="k" * 32, pid=1, start_time=1, member="m1")
            assert await link_direct(os.getpid(), path, expect=identity, from_offset=0) is None
    finally:
        server.close()


async def test_reattach_needs_no_exec(paths) -> None:
    channel, client = await start_local(paths, fake_cli_argv())
    await channel.receive()  # ready
    await channel.ack()
    identity, acked = channel.identity, channel.acked
    await channel.detach()
    await reap(client)
    again = await keeper_sandbox.attach(NoEngine(), "c1", paths, from_offset=acked, expect=identity,
                                        init_pid=os.getpid())
    assert isinstance(again.stream, SocketBytes)
    await again.send(ECHO)
    assert await again.receive() == ECHO
    await again.shutdown()


@asynccontextmanager
async def symlinked_to_another_keeper(paths: KeeperPaths, tmp_path: Path):
    """Two local keepers (members m1 and m2), the first one's socket path a symlink to the
    second's socket. Yields both starts' channels and clients and the second's paths."""
    other = KeeperPaths.in_run_dir(str(tmp_path / "other"))
    mine, mine_client = await start_local(paths, fake_cli_argv(), member="m1")
    theirs, theirs_client = await start_local(other, fake_cli_argv(), member="m2")
    try:
        os.unlink(paths.socket)
        os.symlink(other.socket, paths.socket)
        yield SimpleNamespace(mine=mine, mine_client=mine_client, theirs=theirs, other=other)
    finally:
        for ch, client in ((mine, mine_client), (theirs, theirs_client)):
            await ch.detach()  # a second close of a closed start is nothing
            await reap(client)
        subprocess.run(retire_argv(other, grace_s=1.0), check=False, timeout=30)


async def test_a_symlink_to_another_keeper_is_refused_by_its_identity(paths, tmp_path) -> None:
    async with symlinked_to_another_keeper(paths, tmp_path) as two:
        with pytest.raises(KeeperIdentityMismatch):
            await link_direct(os.getpid(), paths.socket, expect=two.mine.identity, from_offset=0)
        # The other keeper refused the attach itself (it names another identity): its own
        # client keeps its attach, nothing of its output read by the wrong one.
        assert json.loads(await two.theirs.receive())["ready"] > 0
        await two.theirs.send(ECHO)
        assert await two.theirs.receive() == ECHO


async def test_a_start_whose_link_fails_closes_its_exec(paths, tmp_path) -> None:
    async with symlinked_to_another_keeper(paths, tmp_path) as two:
        with pytest.raises(KeeperIdentityMismatch):
            await keeper_sandbox.go_direct(two.mine, os.getpid(), paths)
        with anyio.fail_after(10):
            await two.mine_client.wait()  # the start's client (its exec, in a sandbox) was closed, not left open


class GoneEngine:
    """An engine whose exec finds no sandbox: an attach that reaches it fails."""

    async def exec_attached(self, *args, **kwargs):
        raise NotFound("no such container")


async def test_keeper_link_exec_keeps_every_attach_on_the_exec(paths) -> None:
    """CLOUD_AGENT_KEEPER_LINK=exec: the daemon's keepers never link from the host."""
    assert load_settings({}).keeper_link == "host"
    assert load_settings({"CLOUD_AGENT_KEEPER_LINK": "exec"}).keeper_link == "exec"
    with pytest.raises(ValidationError, match="keeper_link"):
        load_settings({"CLOUD_AGENT_KEEPER_LINK": "both"})
    channel, client = await start_local(paths, fake_cli_argv())
    rec = KeeperRecord(user_id="u", chat_id="c", member_id="m1", host_id="h", runtime="codex", container_id="c1",
                       run_dir=str(Path(paths.socket).parent), identity=channel.identity.model_dump(), session={},
                       acked=0, turn=None)
    await channel.detach()
    await reap(client)
    manager = SimpleNamespace(engine=GoneEngine())
    with pytest.raises(KeeperUnavailable, match="is gone"):
        await Keepers(None, manager, buffer_bytes=1 << 20, link_from_host=False).attach(rec, os.getpid())
    linked = await Keepers(None, manager, buffer_bytes=1 << 20).attach(rec, os.getpid())
    assert isinstance(linked.channel.stream, SocketBytes)
    await linked.channel.shutdown()


# -- the pid namespace check, with a process unshare puts in a namespace of its own ----------------

SERVE = """
import os, socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1]); s.listen(1)
print(os.getpid(), flush=True)
c, _ = s.accept()
got = c.recv(100)
print("got", len(got), flush=True)
"""


def in_own_pid_namespace(argv: list[str]) -> subprocess.Popen:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.fail("the namespace checks need root and util-linux's unshare (scripts/test runs as root)")
    return subprocess.Popen(["unshare", "--pid", "--fork", "--kill-child", *argv], stdout=subprocess.PIPE, text=True)


def host_pid_of_child(unshare: subprocess.Popen) -> int:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        children = Path(f"/proc/{unshare.pid}/task/{unshare.pid}/children").read_text().split()
        if children:
            return int(children[0])
        time.sleep(0.01)
    raise AssertionError("unshare started no child")


def test_a_peer_outside_the_sandbox_namespace_gets_no_byte(tmp_path) -> None:
    """The "sandbox" is a process in a pid namespace of its own; the socket its path names is
    served by this process, in the host's: refused before anything is sent."""
    path = str(tmp_path / "keeper.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
    sandbox = in_own_pid_namespace(["sleep", "60"])
    try:
        init = host_pid_of_child(sandbox)
        with pytest.raises(NoDirectLink, match="outside the sandbox's pid namespace"):
            connect_in_sandbox(init, path)
        conn, _ = server.accept()  # the connect was made (that is how the peer is known) ...
        conn.settimeout(2)
        assert conn.recv(100) == b""  # ... and closed without a byte
        conn.close()
    finally:
        sandbox.kill()
        sandbox.wait()
        server.close()


def test_a_peer_inside_the_sandbox_namespace_is_linked(tmp_path) -> None:
    path = str(tmp_path / "keeper.sock")
    sandbox = in_own_pid_namespace([sys.executable, "-I", "-S", "-c", SERVE, path])
    try:
        assert sandbox.stdout is not None
        assert sandbox.stdout.readline().strip() == "1"  # the server is the namespace's init
        sock = connect_in_sandbox(host_pid_of_child(sandbox), path)
        sock.sendall(b"hello")
        sock.close()
        assert sandbox.stdout.readline().strip() == "got 5"
    finally:
        sandbox.kill()
        sandbox.wait()
