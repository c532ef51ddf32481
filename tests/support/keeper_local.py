"""Keepers as local processes: ``ca-keeper`` run with this machine's python3 (tests, benches)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
from anyio.abc import Process

from sandbox_manager.exec_stream import ExecStreamClosed
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_identity import KeeperIdentity
from sandbox_manager.keeper_sandbox import KeeperPaths, attach_argv, run_prefix

ROOT = Path(__file__).resolve().parents[2]
KEEPER = ROOT / "images" / "sandbox" / "helpers" / "ca-keeper"
FAKE_CLI = Path(__file__).with_name("keeper_fake_cli.py")


class ProcessBytes:
    """A local ``ca-keeper run|attach`` process as a keeper byte stream (sandbox_manager.keeper.ByteStream)."""

    def __init__(self, process: Process) -> None:
        self.process = process

    async def send_bytes(self, data: bytes) -> None:
        assert self.process.stdin is not None
        try:
            await self.process.stdin.send(data)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise ExecStreamClosed(f"keeper client stdin is gone: {exc!r}") from exc

    async def receive_bytes(self) -> bytes:
        assert self.process.stdout is not None
        try:
            return await self.process.stdout.receive(65536)
        except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
            return b""

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for s in (self.process.stdin, self.process.stdout):
                if s is not None:
                    try:
                        await s.aclose()
                    except (anyio.BrokenResourceError, OSError):
                        pass

    def diagnostics(self) -> str:
        return ""


def keeper_cmd() -> tuple[str, ...]:
    # -I -S: the standard library only, as in the image (and no slow version-manager shim)
    return (sys.executable, "-I", "-S", str(KEEPER))


def fake_cli_argv() -> list[str]:
    return [sys.executable, "-I", "-S", str(FAKE_CLI)]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# As ``docker exec`` starts a keeper's client in a sandbox: with its three stdio only. uvloop's
# spawn (the product's loop, runner.event_loop) leaves descriptors of its own open in a child
# (its stdio's duplicates, /dev/null, a pipe), and a keeper hands its CLI whatever it inherited
# that is not close-on-exec.
ONLY_STDIO = (sys.executable, "-I", "-S", "-c",
              "import os, sys; os.closerange(3, os.sysconf('SC_OPEN_MAX')); os.execvp(sys.argv[1], sys.argv[1:])")


async def open_client(argv: list[str], env: dict[str, str] | None = None) -> Process:
    return await anyio.open_process([*ONLY_STDIO, *argv], stdin=-1, stdout=-1, stderr=-1, env=env)


async def start_local(paths: KeeperPaths, cli: list[str], *, member: str = "m1", tags: dict[str, str] | None = None,
                      launch_opts: list[str] | None = None, buffer_bytes: int | None = None,
                      env: dict[str, str] | None = None,
                      linger_s: float | None = None) -> tuple[KeeperChannel, Process]:
    argv = run_prefix(paths, member=member, tags=tags, buffer_bytes=buffer_bytes, linger_s=linger_s,
                      keeper=keeper_cmd())
    argv += ["--pidfile", paths.cli_pidfile, *(launch_opts or []), "--", *cli]
    proc = await open_client(argv, env)
    try:
        channel = await KeeperChannel.open(ProcessBytes(proc), timeout_s=20)
    except BaseException:
        await reap(proc)
        raise
    return channel, proc


async def attach_local(paths: KeeperPaths, *, from_offset: int, expect: KeeperIdentity | None = None
                       ) -> tuple[KeeperChannel, Process]:
    proc = await open_client(attach_argv(paths, keeper=keeper_cmd()))
    try:
        channel = await KeeperChannel.open(ProcessBytes(proc), from_offset=from_offset, expect=expect, timeout_s=20)
    except BaseException:
        await reap(proc)
        raise
    return channel, proc


async def reap(proc: Process) -> None:
    """Close a client process's pipes (it detaches and exits) and wait for it."""
    with anyio.CancelScope(shield=True):
        if proc.stdin is not None:
            try:
                await proc.stdin.aclose()
            except Exception:  # noqa: BLE001 - best effort
                pass
        with anyio.move_on_after(5):
            await proc.wait()
        if proc.returncode is None:
            proc.kill()
        await proc.aclose()
