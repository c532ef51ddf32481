"""ca-keeper as real local processes (host python3) with a small fake CLI.

The client processes stand in for the attached exec: killing one is what a daemon's death
(or a closed exec) does to the keeper.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
from pathlib import Path

import anyio
import pytest

from sandbox_manager import keeper_wire as wire
from sandbox_manager.keeper_errors import (
    KeeperBroken,
    KeeperDetached,
    KeeperIdentityMismatch,
    KeeperRefused,
    KeeperUnavailable,
)
from sandbox_manager.keeper_sandbox import KeeperPaths, retire_argv, status_argv
from tests.support.keeper_local import (
    KEEPER,
    attach_local,
    fake_cli_argv,
    keeper_cmd,
    pid_alive,
    reap,
    start_local,
)

pytestmark = pytest.mark.anyio


@pytest.fixture
def paths(tmp_path):
    p = KeeperPaths.in_run_dir(str(tmp_path / "run"))
    yield p
    # whatever a test left running: end it through the product's own retire script
    subprocess.run(retire_argv(p, grace_s=1.0), check=False, timeout=30)


def status(paths: KeeperPaths) -> dict:
    out = subprocess.run(status_argv(paths, keeper=keeper_cmd()), capture_output=True, check=False, timeout=20)
    return json.loads(out.stdout)


def cli_pid(paths: KeeperPaths) -> int:
    return int(Path(paths.cli_pidfile).read_text())


def keeper_pid(paths: KeeperPaths) -> int:
    return int(Path(paths.pidfile).read_text())


async def test_start_reports_its_identity_and_owns_the_cli(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv(), member="member-a", tags={"locator": "L-1", "x": "y"})
        ready = json.loads(await ch.receive())
        h = ch.hello
        assert ready == {"ready": h.pid}
        assert h.pid == cli_pid(paths) and os.getpgid(h.pid) == h.pid  # ca-launch made it a group leader
        assert h.keeper_pid == keeper_pid(paths) and h.keeper_pid != client.pid
        assert os.getsid(h.keeper_pid) == h.keeper_pid  # its own session: not the client's
        stat_line = Path(f"/proc/{h.pid}/stat").read_text()
        assert h.start_time == int(stat_line.rsplit(")", 1)[1].split()[19])
        assert (h.member, h.tags) == ("member-a", {"locator": "L-1", "x": "y"})
        assert len(h.keeper_id) == 32 and int(h.keeper_id, 16) >= 0
        # the CLI's ready line may reach the keeper before the hello is framed (or not yet)
        assert h.written in (0, len(b'{"ready":%d}\n' % h.pid))
        assert (h.acked, h.broken, h.accepted, h.exit) == (0, False, True, None)
        st = os.stat(paths.socket)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.getuid()
        await ch.send(b'{"op":"echo","n":"\xe4\xb8\x96"}')
        assert await ch.receive() == b'{"op":"echo","n":"\xe4\xb8\x96"}'
        assert ch.offset == len(b'{"ready":%d}\n' % h.pid) + len(b'{"op":"echo","n":"\xe4\xb8\x96"}\n')
        assert ch.alive
        await ch.detach()
        await reap(client)


async def test_client_killed_mid_stream_reattach_from_ack_reads_every_byte_once(paths) -> None:
    """Three daemons in a row die (kill -9 of their client) mid-stream; what they committed
    plus what the last one reads is the CLI's output exactly once, in order."""
    n, size = 30000, 60
    with anyio.fail_after(120):
        ch, client = await start_local(paths, fake_cli_argv())
        ident = ch.identity
        committed: list[bytes] = [await ch.receive()]  # the ready line
        await ch.ack()
        await ch.send(json.dumps({"op": "emit", "n": n, "size": size, "tag": "t"}).encode())
        await ch.send(b'{"op":"echo","last":true}')
        for stop_after in (3000, 11000, 19000):
            pending: list[bytes] = []
            while len(committed) + len(pending) - 1 < stop_after:
                pending.append(await ch.receive())
            # commit (and ack) only part of what was read; the rest must come again
            half = len(pending) // 2
            committed += pending[:half]
            await ch.ack(ch.offset - sum(len(x) + 1 for x in pending[half:]))
            await anyio.sleep(0.05)  # the ack frame reaches the keeper before the client dies
            client.send_signal(signal.SIGKILL)
            await client.wait()
            assert pid_alive(ident.pid) and pid_alive(keeper_pid(paths)), "keeper and CLI outlive the client"
            acked = ch.acked
            await reap(client)
            ch, client = await attach_local(paths, from_offset=acked, expect=ident)
            assert ch.hello.acked == acked and ch.offset == acked
        while True:
            line = await ch.receive()
            committed.append(line)
            if line == b'{"op":"echo","last":true}':
                break
        await ch.detach()
        await reap(client)
    lines = [json.loads(x) for x in committed[1:-1]]
    assert [x["seq"] for x in lines] == list(range(n))
    assert {(x["tag"], x["pad"]) for x in lines} == {("t", "x" * size)}


async def test_closing_the_client_detaches_and_the_keeper_keeps_what_the_cli_writes(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        ident = ch.identity
        await ch.receive()
        await ch.ack()
        acked = ch.acked
        await ch.send(b'{"op":"emit","n":5,"size":1,"tag":"while-away"}')
        await anyio.sleep(0.2)
        await ch.detach()  # the exec's stdin closes: the client exits, nothing else does
        await client.wait()
        assert client.returncode == 0
        assert pid_alive(ident.pid)
        ch, client = await attach_local(paths, from_offset=acked, expect=ident)
        got = [json.loads(await ch.receive()) for _ in range(5)]
        assert [(g["tag"], g["seq"]) for g in got] == [("while-away", i) for i in range(5)]
        await ch.detach()
        await reap(client)


async def test_another_identity_is_refused_and_the_keeper_is_untouched(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv(), tags={"locator": "L"})
        real = ch.identity
        await ch.receive()
        await ch.detach()
        await reap(client)
        for forged, field in ((real.model_copy(update={"keeper_id": "0" * 32}), "keeper_id"),
                              (real.model_copy(update={"start_time": real.start_time + 1}), "start_time"),
                              (real.model_copy(update={"tags": {"locator": "other"}}), "tags")):
            with pytest.raises(KeeperIdentityMismatch) as err:
                await attach_local(paths, from_offset=0, expect=forged)
            assert err.value.field == field
        assert status(paths)["hello"]["acked"] == 0  # nothing was acknowledged to it
        ch, client = await attach_local(paths, from_offset=0, expect=real)
        assert await ch.receive() == b'{"ready":%d}' % real.pid  # still all there, from 0
        await ch.detach()
        await reap(client)


async def test_an_attach_for_another_keeper_leaves_the_attached_client_alone(paths) -> None:
    """The keeper itself refuses an attach that names another identity, before it would
    supersede its client: a path that leads a member's attach to another member's keeper takes
    nothing from that member's turn."""
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv(), member="m2")
        real = ch.identity
        forged = real.model_copy(update={"keeper_id": "0" * 32, "member": "m1"})
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(20)
            sock.connect(paths.socket)
            sock.sendall(wire.attach_frame(0, forged.model_dump()))
            decoder, frames = wire.FrameDecoder(), []
            while chunk := sock.recv(65536):  # until the keeper closes the connection
                frames += decoder.feed(chunk)
        finally:
            sock.close()
        assert [f.kind for f in frames] == [wire.HELLO]  # the hello that refuses, and nothing else
        hello = json.loads(frames[0].payload)
        assert hello["accepted"] is False
        assert hello["refused"] == "identity_mismatch"
        assert hello["keeper_id"] == real.keeper_id
        with pytest.raises(KeeperIdentityMismatch) as err:  # through the channel: the hello's check names it
            await attach_local(paths, from_offset=0, expect=forged)
        assert err.value.field == "keeper_id"
        # the start's attach is still the keeper's client: the CLI's output and its echo reach it
        assert await ch.receive() == b'{"ready":%d}' % real.pid
        await ch.send(b'{"op":"echo","payload":"still mine"}')
        assert await ch.receive() == b'{"op":"echo","payload":"still mine"}'
        assert status(paths)["hello"]["acked"] == 0
        await ch.detach()
        await reap(client)


async def test_keeper_killed_attach_fails_clearly(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        ident = ch.identity
        await ch.receive()
        os.kill(keeper_pid(paths), signal.SIGKILL)
        with pytest.raises(KeeperDetached, match="before the CLI's output did"):
            await ch.receive()
        await reap(client)
        with pytest.raises(KeeperUnavailable, match="nothing answers on .*keeper.sock") as err:
            await attach_local(paths, from_offset=0, expect=ident)
        assert err.value.reason == "no_keeper"
        assert status(paths)["error"] == "no_keeper"


async def test_overflow_breaks_the_keeper_and_every_later_attach_is_told(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv(), buffer_bytes=64 * 1024)
        ident = ch.identity
        await ch.receive()
        await ch.send(b'{"op":"emit","n":2000,"size":100}')  # ~240 KB, nothing acknowledged
        with pytest.raises(KeeperBroken, match="more than 65536 bytes of output not acknowledged"):
            while True:
                await ch.receive()
        await reap(client)
        with pytest.raises(KeeperBroken, match="more than 65536 bytes"):
            await attach_local(paths, from_offset=0, expect=ident)
        s = status(paths)["hello"]
        assert s["broken"] is True and s["written"] > 64 * 1024
        assert pid_alive(ident.pid)  # broken is a verdict for the daemon: the member retires


async def test_failed_precheck_is_the_same_launch_error_line_and_exit_code(paths, tmp_path) -> None:
    missing = str(tmp_path / "absent.jsonl")
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv(), launch_opts=["--require-file", missing])
        assert json.loads(await ch.receive()) == {"type": "launch_error", "reason": "missing_file", "path": missing}
        assert await ch.receive() is None
        exit_ = await ch.wait_exit()
        assert exit_ is not None and exit_.code == 3
        # ca-launch run directly prints the very same line and exits 3
        direct = subprocess.run(["python3", str(KEEPER.with_name("ca-launch")), "--require-file",
                                 missing, "--", "true"], capture_output=True, check=False, timeout=20)
        assert direct.returncode == 3 and json.loads(direct.stdout) == {"type": "launch_error",
                                                                         "reason": "missing_file", "path": missing}
        await ch.ack()  # all delivered and acknowledged: the keeper is done
        with anyio.fail_after(10):
            while os.path.exists(paths.socket):
                await anyio.sleep(0.05)
        await reap(client)


async def test_a_header_mismatch_and_a_failed_exec_are_launch_errors_through_the_keeper(paths, tmp_path) -> None:
    """ca-launch runs in a fork of the keeper's interpreter (issue 16): its header check (json
    imported where it is used) and its exec failure say what they always said."""
    transcript = tmp_path / "t.jsonl"
    transcript.write_text('{"id": "other-session"}\n')
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv(),
                                       launch_opts=["--require-header", str(transcript), "id", "wanted-session"])
        assert json.loads(await ch.receive()) == {"type": "launch_error", "reason": "header_mismatch",
                                                  "path": str(transcript), "key": "id", "expected": "wanted-session",
                                                  "observed": "other-session"}
        exit_ = await ch.wait_exit()
        assert exit_ is not None and exit_.code == 3
        await ch.ack()
        await reap(client)
    with anyio.fail_after(30):
        ch, client = await start_local(paths, [str(tmp_path / "no-such-cli")])
        assert json.loads(await ch.receive()) == {"type": "launch_error", "reason": "exec_failed",
                                                  "command": str(tmp_path / "no-such-cli"),
                                                  "detail": "No such file or directory"}
        exit_ = await ch.wait_exit()
        assert exit_ is not None and exit_.code == 3
        await ch.ack()
        await reap(client)


async def test_the_cli_holds_only_its_own_stdio(paths) -> None:
    """Started from a fork of the keeper, the CLI inherits none of the keeper's descriptors (its
    listening socket, its log, the pipe to the starting exec): only its three pipes."""
    listing = "import os; print(sorted(int(f) for f in os.listdir('/proc/self/fd')), flush=True)"
    with anyio.fail_after(30):
        ch, client = await start_local(paths, ["python3", "-I", "-S", "-c", listing])
        # 3 is the directory listdir itself opened
        assert json.loads(await ch.receive()) == [0, 1, 2, 3]
        exit_ = await ch.wait_exit()
        assert exit_ is not None and exit_.code == 0
        await ch.ack()
        await reap(client)


async def test_reattach_supersedes_and_offsets_outside_the_log_are_refused(paths) -> None:
    with anyio.fail_after(30):
        first, c1 = await start_local(paths, fake_cli_argv())
        ident = first.identity
        await first.receive()
        await first.ack()
        with pytest.raises(KeeperRefused, match="offset_ahead") as err:
            await attach_local(paths, from_offset=10_000, expect=ident)
        assert err.value.reason == "offset_ahead"
        with pytest.raises(KeeperRefused, match="offset_released"):
            await attach_local(paths, from_offset=0, expect=ident)
        second, c2 = await attach_local(paths, from_offset=first.acked, expect=ident)
        with pytest.raises(KeeperDetached, match="newer attach"):
            await first.receive()
        await second.send(b'{"op":"echo","via":2}')
        assert await second.receive() == b'{"op":"echo","via":2}'
        with pytest.raises(KeeperRefused, match="keeper_running") as err:
            await start_local(paths, fake_cli_argv())
        assert err.value.reason == "keeper_running"
        for ch, c in ((first, c1), (second, c2)):
            await ch.detach()
            await reap(c)


async def test_stderr_ring_survives_reattach_and_status(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        ident = ch.identity
        await ch.receive()
        await ch.send(b'{"op":"stderr","text":"warning: one\\n"}')
        await ch.send(b'{"op":"echo"}')
        await ch.receive()
        assert ch.diagnostics() == "warning: one\n"
        await ch.detach()
        await reap(client)
        assert status(paths)["stderr"] == "warning: one\n"
        ch, client = await attach_local(paths, from_offset=0, expect=ident)
        await ch.receive()
        assert ch.diagnostics() == "warning: one\n"
        await ch.detach()
        await reap(client)


async def test_shutdown_ends_the_cli_group_and_the_keeper(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        await ch.receive()
        await ch.send(b'{"op":"spawn"}')
        sleeper = json.loads(await ch.receive())["spawned"]
        kpid, cpid = keeper_pid(paths), ch.hello.pid
        exit_ = await ch.shutdown(grace_s=1.0)
        assert exit_ is not None and exit_.signal == signal.SIGTERM
        await reap(client)
        for _ in range(100):
            if not any(map(pid_alive, (kpid, cpid, sleeper))):
                break
            await anyio.sleep(0.05)
        assert not any(map(pid_alive, (kpid, cpid, sleeper)))
        assert not os.path.exists(paths.socket) and not os.path.exists(paths.pidfile)


async def test_retire_script_ends_keeper_and_group_even_when_nobody_is_attached(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        await ch.receive()
        await ch.send(b'{"op":"spawn"}')
        sleeper = json.loads(await ch.receive())["spawned"]
        kpid, cpid = keeper_pid(paths), ch.hello.pid
        await ch.detach()
        await reap(client)
        done = await anyio.run_process(retire_argv(paths, grace_s=3.0), check=False)
        assert done.returncode == 0
        assert not any(map(pid_alive, (kpid, cpid, sleeper)))
        assert not any(os.path.exists(p) for p in (paths.socket, paths.pidfile, paths.cli_pidfile))


async def test_cli_exit_is_delivered_after_reattach(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        ident = ch.identity
        await ch.receive()
        await ch.ack()
        acked = ch.acked
        await ch.send(b'{"op":"echo","bye":1}')
        await ch.send(b'{"op":"exit","code":7}')
        await anyio.sleep(0.3)
        client.send_signal(signal.SIGKILL)
        await reap(client)
        ch, client = await attach_local(paths, from_offset=acked, expect=ident)
        assert ch.hello.exit is not None and ch.hello.exit.code == 7
        assert ch.hello.eof_at == ch.hello.written
        assert await ch.receive() == b'{"op":"echo","bye":1}'
        assert await ch.receive() is None
        assert ch.exit is not None and ch.exit.code == 7 and not ch.alive
        await ch.ack()
        await ch.detach()
        await reap(client)


async def test_retire_leaves_a_reused_keeper_pid_alone(paths) -> None:
    """After a sandbox restart the recorded keeper pid may name another process."""
    os.makedirs(os.path.dirname(paths.pidfile), exist_ok=True)
    other = await anyio.open_process(["sleep", "30"])
    try:
        Path(paths.pidfile).write_text(f"{other.pid}\n")
        done = await anyio.run_process(retire_argv(paths, grace_s=0.5), check=False)
        assert done.returncode == 0
        assert other.returncode is None and pid_alive(other.pid)
        assert not os.path.exists(paths.pidfile)
    finally:
        other.kill()
        await other.aclose()


async def test_the_turn_note_comes_back_with_every_hello_and_a_reattach_reads_to_its_offset(paths) -> None:
    """SPEC 14's turn in flight kept by the keeper: the note written with a turn's input is
    in the next attach's hello (and the status'); the attach starts at the acknowledged offset
    and ``skip_to`` drops the output before the turn; an empty note clears it."""
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        ident = ch.identity
        assert (ch.hello.turn_notes, ch.hello.turn_note) == (True, None)
        await ch.receive()  # the ready line
        await ch.ack()
        acked = ch.acked
        await ch.send(b'{"op":"echo","n":"between turns"}')
        assert await ch.receive() == b'{"op":"echo","n":"between turns"}'
        turn_at = ch.offset  # read, not acknowledged: the store's offset stays at ``acked``
        note = json.dumps({"job": "j-1", "offset": turn_at, "text": "caf\u00e9"})
        ch.note_with_input(note)
        await ch.send(b'{"op":"echo","n":"the turn"}')
        assert await ch.receive() == b'{"op":"echo","n":"the turn"}'
        client.send_signal(signal.SIGKILL)  # the daemon dies mid-turn
        await client.wait()
        await reap(client)
        assert status(paths)["hello"]["turn_note"] == note
        ch, client = await attach_local(paths, from_offset=acked, expect=ident)
        assert (ch.hello.turn_note, ch.hello.acked, ch.offset) == (note, acked, acked)
        await ch.skip_to(json.loads(ch.hello.turn_note)["offset"])
        assert ch.offset == turn_at
        assert await ch.receive() == b'{"op":"echo","n":"the turn"}'  # the turn's output, from its start
        ch.note_with_input("")
        await ch.send(b'{"op":"echo","n":"after the turn"}')
        assert await ch.receive() == b'{"op":"echo","n":"after the turn"}'
        await ch.detach()
        await reap(client)
        ch, client = await attach_local(paths, from_offset=acked, expect=ident)
        assert ch.hello.turn_note is None
        with pytest.raises(KeeperUnavailable, match="not to the turn's start at 5"):
            await ch.skip_to(5, timeout_s=0.5)  # inside the ready line: never a line boundary
        await ch.detach()
        await reap(client)


async def test_a_turn_note_that_is_not_utf8_is_refused(paths) -> None:
    with anyio.fail_after(30):
        ch, client = await start_local(paths, fake_cli_argv())
        await ch.receive()
        await ch._send(wire.encode(wire.NOTE, b"\xff\xfe"))
        with pytest.raises(KeeperRefused, match="not UTF-8"):
            while True:
                await ch.receive()
        await reap(client)
