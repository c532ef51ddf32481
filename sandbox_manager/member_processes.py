"""Member processes inside a chat's sandbox: where a member's files live, writing its config
files, launching its CLI attached, retiring a process group, and reaping orphans on start.

Closing an exec client never ends the process inside (SPEC section 7): every process is
started as a group leader with a pidfile, and retired by killing that group.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from sandbox_manager.engine import AGENT_HOME, Engine, NotFound
from sandbox_manager.exec_stream import ExecStream
from sandbox_manager.identity import LABEL_HOST, member_key
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandbox_config import SandboxConfig

log = structlog.get_logger("sandbox")

WORKSPACE = f"{AGENT_HOME}/workspace"
MEMBERS_DIR = f"{AGENT_HOME}/members"
KILL_GRACE_S = 3.0  # a retired process group gets this long between TERM and KILL


@dataclass(frozen=True)
class MemberDirs:
    home: str
    workspace: str
    run_dir: str


@dataclass
class MemberProcess:
    """A CLI process in a sandbox: its attached stream and how to kill its group."""

    container_id: str
    stream: ExecStream
    pidfile: str


class MemberProcesses:
    """The process side of the sandbox manager (it inherits these): needs ``engine`` and
    ``config.host_id``."""

    engine: Engine
    config: SandboxConfig

    @staticmethod
    def member_dirs(member_id: str) -> MemberDirs:
        base = f"{MEMBERS_DIR}/{member_key(member_id)}"
        return MemberDirs(home=f"{base}/home", workspace=WORKSPACE, run_dir=f"{base}/run")

    async def launch(self, sandbox: Sandbox, *, argv: list[str], env: dict[str, str], workdir: str,
                     pidfile: str, files: bytes | None = None) -> MemberProcess:
        """``files``: the launch's files (sandbox_manager.launch_files), sent first on its stdin
        (``ca-launch --files-on-stdin`` writes them)."""
        stream = await self.engine.exec_attached(sandbox.container_id, argv, env=env, workdir=workdir)
        if files is not None:
            try:
                await stream.send_raw(files)
            except BaseException:
                await stream.aclose()
                raise
        return MemberProcess(container_id=sandbox.container_id, stream=stream, pidfile=pidfile)

    async def kill_group(self, container_id: str, pidfile: str) -> None:
        """Retire a process: kill its whole process group inside the container (TERM, then KILL
        after KILL_GRACE_S). Closing the exec client never ends the process inside (SPEC section 7).
        """
        tries = max(1, int(KILL_GRACE_S / 0.1))
        script = (
            'pg=$(cat "$1" 2>/dev/null) || exit 0; [ -n "$pg" ] || exit 0; '
            'kill -s TERM -- "-$pg" 2>/dev/null || { rm -f "$1"; exit 0; }; i=0; '
            f'while kill -s 0 -- "-$pg" 2>/dev/null; do i=$((i+1)); if [ $i -ge {tries} ]; then '
            'kill -s KILL -- "-$pg" 2>/dev/null; break; fi; sleep 0.1; done; rm -f "$1"'
        )
        try:
            await self.engine.exec_run(container_id, ["sh", "-c", script, "sh", pidfile])
        except NotFound:
            pass

    async def reap_orphans(self, keep: dict[str, set[str]] | None = None) -> int:
        """On daemon start: kill CLI process groups left in retained, running sandboxes, but
        those in ``keep`` (container id -> member run dirs of re-adopted keepers)."""
        killed = 0
        script = (
            f'for f in {MEMBERS_DIR}/*/run/*.pid; do [ -f "$f" ] || continue; d=${{f%/*}}; s=; '
            'for k in "$@"; do [ "$k" = "$d" ] && s=1; done; [ -n "$s" ] && continue; pg=$(cat "$f"); '
            '[ -n "$pg" ] && kill -s KILL -- "-$pg" 2>/dev/null && echo "$pg"; rm -f "$f"; done; exit 0'
        )
        for info in await self.engine.list_labelled(f"{LABEL_HOST}={self.config.host_id}"):
            if not info.running:
                continue
            kept = sorted((keep or {}).get(info.id, ()))
            code, out = await self.engine.exec_run(info.id, ["sh", "-c", script, "sh", *kept])
            n = len(out.split())
            if n:
                log.info("sandbox.reaped", container=info.name, groups=n)
            killed += n
        return killed
