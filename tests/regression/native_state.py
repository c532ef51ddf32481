"""Where each CLI keeps a member's native session state inside the sandbox (LOST and upgrade
regressions delete it, as ``agent``, to prove a resume is refused without it)."""

from __future__ import annotations

import shlex

from drivers.bridge.launch import native_db
from drivers.claude import ClaudeDriver
from drivers.codex import CodexDriver
from drivers.models import Locator
from runner.processes import member_paths
from sandbox_manager.sandboxes import SandboxManager
from state.records import MemberRecord


def agent_sh(docker_client, container_id: str, script: str) -> tuple[int, str]:
    code, out = docker_client.containers.get(container_id).exec_run(["sh", "-c", script], user="agent")
    return code, out.decode(errors="replace")


def native_state_paths(runtime: str, m: MemberRecord) -> str:
    """Shell words naming the member's native session state, exactly where its driver keeps it."""
    assert m.locator is not None
    paths = member_paths(SandboxManager.member_dirs(m.home_member_id))
    loc = Locator(id=m.locator.id, path=m.locator.path)
    if runtime == "claude":
        return shlex.quote(ClaudeDriver().transcript(paths, loc))  # <CLAUDE_CONFIG_DIR>/projects/<cwd>/<id>.jsonl
    if runtime == "codex":
        return CodexDriver.rollout_glob(paths, loc)  # CODEX_HOME/sessions/Y/M/D/rollout-*-<id>.jsonl (a glob)
    if runtime == "pi":
        assert loc.path
        return shlex.quote(loc.path)  # the session file the locator names
    db = native_db(runtime, paths.home)  # XDG_DATA_HOME/<cli>/<cli>.db (+ WAL files)
    return " ".join(shlex.quote(p) for p in (db, f"{db}-wal", f"{db}-shm"))
