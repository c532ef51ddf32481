"""Keepers inside a sandbox through the engine seam: start, re-attach, status, retire.

A start is one attached exec (``ca-keeper run … -- LAUNCH``: the keeper forks off and the
exec becomes its first client, until :func:`go_direct` links to the keeper's socket from the
host), a re-attach after a daemon restart is a link from the host too, or one attached exec
(``ca-keeper attach``) where the host cannot make one (sandbox_manager.keeper_link); a status
query and a retire are one plain exec each.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

from sandbox_manager.engine import Engine, NotFound
from sandbox_manager.exec_stream import ExecStreamClosed
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_bytes import ExecBytes
from sandbox_manager.keeper_errors import KeeperProtocolError, KeeperUnavailable
from sandbox_manager.keeper_identity import KeeperHello, KeeperIdentity
from sandbox_manager.keeper_link import link_direct

IN_SANDBOX_KEEPER = "ca-keeper"


@dataclass(frozen=True)
class KeeperPaths:
    """Where a member's keeper lives inside the sandbox (its run dir: agent-owned)."""

    socket: str
    pidfile: str  # the keeper's own pid
    cli_pidfile: str  # the CLI's pid = process group (written by ca-launch)
    log: str

    @classmethod
    def in_run_dir(cls, run_dir: str) -> KeeperPaths:
        return cls(socket=f"{run_dir}/keeper.sock", pidfile=f"{run_dir}/keeper.pid",
                   cli_pidfile=f"{run_dir}/cli.pid", log=f"{run_dir}/keeper.log")


class KeeperStatus(BaseModel):
    hello: KeeperHello
    stderr: str


def run_prefix(paths: KeeperPaths, *, member: str, tags: dict[str, str] | None = None,
               buffer_bytes: int | None = None, linger_s: float | None = None, files_on_stdin: bool = False,
               keeper: Sequence[str] = (IN_SANDBOX_KEEPER,)) -> list[str]:
    """``ca-keeper run`` and its own options; append ca-launch's options and ``-- ARGV``
    (``LaunchSpec.launcher_argv(pidfile=paths.cli_pidfile, launcher=run_prefix(...))``).
    ``files_on_stdin``: the start's first bytes are the launch's files (:func:`start`'s ``files``)."""
    argv = [*keeper, "run", "--socket", paths.socket, "--keeper-pidfile", paths.pidfile, "--log", paths.log,
            "--member", member]
    if files_on_stdin:
        argv.append("--files-on-stdin")
    for key, value in sorted((tags or {}).items()):
        if not key or "=" in key:
            raise ValueError(f"tag name {key!r} must be non-empty and without '='")
        argv += ["--tag", f"{key}={value}"]
    if buffer_bytes is not None:
        argv += ["--buffer-bytes", str(buffer_bytes)]
    if linger_s is not None:
        argv += ["--linger-s", str(linger_s)]
    return argv


def attach_argv(paths: KeeperPaths, keeper: Sequence[str] = (IN_SANDBOX_KEEPER,)) -> list[str]:
    return [*keeper, "attach", "--socket", paths.socket]


def status_argv(paths: KeeperPaths, keeper: Sequence[str] = (IN_SANDBOX_KEEPER,)) -> list[str]:
    return [*keeper, "status", "--socket", paths.socket]


def retire_argv(paths: KeeperPaths, grace_s: float = 3.0) -> list[str]:
    """A shell script that ends the keeper (which ends its CLI) and the CLI's process group.

    TERM to both, up to ``grace_s`` for them to go (zombies count as gone), then KILL;
    pidfiles and socket removed. Works whether or not the keeper still answers (killed
    keeper, wedged CLI). The keeper pid is signalled only while its command line names
    this socket, so a pid reused after a sandbox restart is left alone.
    """
    tries = max(1, int(grace_s / 0.1))
    script = (
        'k=$(cat "$1" 2>/dev/null); c=$(cat "$2" 2>/dev/null); '
        '[ -n "$k" ] && ! tr "\\0" "\\n" < "/proc/$k/cmdline" 2>/dev/null | grep -qxF -- "$3" && k=; '
        'left() { ps -eo pid=,pgid=,stat= | while read -r p g s; do case "$s" in Z*) continue;; esac; '
        '{ [ -n "$k" ] && [ "$p" = "$k" ]; } || { [ -n "$c" ] && [ "$g" = "$c" ]; } && echo x; done | grep -q x; }; '
        '[ -n "$k" ] && kill -s TERM "$k" 2>/dev/null; [ -n "$c" ] && kill -s TERM -- "-$c" 2>/dev/null; i=0; '
        f'while left; do i=$((i+1)); if [ $i -ge {tries} ]; then '
        '[ -n "$k" ] && kill -s KILL "$k" 2>/dev/null; [ -n "$c" ] && kill -s KILL -- "-$c" 2>/dev/null; break; fi; '
        'sleep 0.1; done; rm -f "$1" "$2" "$3"; exit 0'
    )
    return ["sh", "-c", script, "sh", paths.pidfile, paths.cli_pidfile, paths.socket]


async def start(engine: Engine, container_id: str, argv: list[str], *, env: dict[str, str] | None = None,
                workdir: str | None = None, timeout_s: float = 30.0,
                auto_ack_bytes: int | None = None, files: bytes | None = None) -> KeeperChannel:
    """Start a keeper and its CLI (``argv`` from :func:`run_prefix` + launch options) and
    attach to it, all in one attached exec. ``files``: the launch's files
    (:func:`sandbox_manager.launch_files.encode`), sent first: ``run_prefix(files_on_stdin=True)``."""
    stream = await engine.exec_attached(container_id, argv, env=env, workdir=workdir)
    if files is not None:
        try:
            await stream.send_raw(files)
        except ExecStreamClosed as exc:
            await stream.aclose()
            raise KeeperUnavailable(f"the keeper's start took no files: {exc}") from exc
    return await KeeperChannel.open(ExecBytes(stream), from_offset=0,
                                    timeout_s=timeout_s, auto_ack_bytes=auto_ack_bytes)


async def go_direct(channel: KeeperChannel, init_pid: int | None, paths: KeeperPaths) -> KeeperChannel:
    """After a start: the same keeper through its socket from the host, the start's exec (its
    relay) closed, when the host can link to it (sandbox_manager.keeper_link); else ``channel``.
    Nothing has been read from ``channel`` yet: the new link reads from where it stands."""
    try:
        direct = await link_direct(init_pid, paths.socket, expect=channel.identity, from_offset=channel.offset,
                                   auto_ack_bytes=channel.auto_ack_bytes)
    except BaseException:
        await channel.detach()  # the start fails with the link's error: nothing keeps its exec
        raise
    if direct is None:
        return channel
    await channel.detach()  # superseded by the new link already: the relay ends with its exec
    return direct


async def attach(engine: Engine, container_id: str, paths: KeeperPaths, *, from_offset: int,
                 expect: KeeperIdentity | None, timeout_s: float = 30.0,
                 auto_ack_bytes: int | None = None, init_pid: int | None = None) -> KeeperChannel:
    """Re-attach from ``from_offset``, refusing any keeper but ``expect``: through the keeper's
    socket from the host when ``init_pid`` (the sandbox's init, a host pid) lets it, else one
    attached exec."""
    if expect is not None:
        direct = await link_direct(init_pid, paths.socket, expect=expect, from_offset=from_offset,
                                   timeout_s=timeout_s, auto_ack_bytes=auto_ack_bytes)
        if direct is not None:
            return direct
    try:
        stream = await engine.exec_attached(container_id, attach_argv(paths))
    except NotFound as exc:
        raise KeeperUnavailable(f"sandbox {container_id[:12]} is gone: {exc}") from exc
    return await KeeperChannel.open(ExecBytes(stream), from_offset=from_offset, expect=expect,
                                    timeout_s=timeout_s, auto_ack_bytes=auto_ack_bytes)


async def status(engine: Engine, container_id: str, paths: KeeperPaths) -> KeeperStatus | None:
    """The keeper's hello and stderr ring without touching its attached client; None when no
    keeper answers on ``paths.socket``."""
    code, out = await engine.exec_run(container_id, status_argv(paths))
    try:
        answer = json.loads(out.decode(errors="replace").strip().splitlines()[-1])
    except (ValueError, IndexError) as exc:
        raise KeeperProtocolError(f"ca-keeper status answered {out[:200]!r} (exit {code})") from exc
    if code != 0 or "error" in answer:
        if answer.get("error") == "no_keeper":
            return None
        raise KeeperProtocolError(f"ca-keeper status failed: {answer}")
    try:
        return KeeperStatus.model_validate(answer)
    except ValidationError as exc:
        raise KeeperProtocolError(f"bad keeper status: {exc}") from exc


async def retire(engine: Engine, container_id: str, paths: KeeperPaths, grace_s: float = 3.0) -> None:
    """End the keeper and the CLI's process group (closing an exec never would)."""
    try:
        await engine.exec_run(container_id, retire_argv(paths, grace_s))
    except NotFound:
        pass
