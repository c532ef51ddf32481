"""Claude launch plans (NEW, RESTORED, fork) and the in-sandbox fork-point resolver."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from drivers.claude import ClaudeDriver, ClaudeSettings
from drivers.claude.launch import FORK_RESOLVER, KEY_ENV
from drivers.claude.fork_at import fork_anchor, is_prompt
from drivers.claude.wire import is_uuid
from drivers.models import GatewayConfig, Locator, MemberPaths
from drivers.registry import get_driver

KEY = "sk-ant-plan-canary-3e9d"
PATHS = MemberPaths(home="/home/agent/members/m1", workspace="/home/agent/workspace", run_dir="/run/m1")
GW = GatewayConfig(base_url="http://127.0.0.1:9000/", key=KEY, model="fixture-model")
SID = "11111111-2222-4333-8444-555555555555"
TRANSCRIPT = Path(__file__).resolve().parents[1] / "data" / "claude" / "transcript.jsonl"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_registry_returns_the_claude_driver() -> None:
    assert isinstance(get_driver("claude"), ClaudeDriver)


def test_new_launch_mints_the_session_id() -> None:
    launch = ClaudeDriver().plan(PATHS, GW, None)
    spec = launch.spec
    assert launch.resume is False and launch.expected is not None and is_uuid(launch.expected.id)
    assert spec.argv[:7] == ["claude", "-p", "--output-format", "stream-json", "--input-format", "stream-json",
                             "--verbose"]
    assert _flag(spec.argv, "--session-id") == launch.expected.id
    assert _flag(spec.argv, "--model") == "fixture-model"
    assert _flag(spec.argv, "--permission-mode") == "bypassPermissions"
    assert "--resume" not in spec.argv and spec.require_files == []
    assert spec.cwd == PATHS.workspace
    env = spec.env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9000"
    assert env["CLAUDE_CONFIG_DIR"] == "/home/agent/members/m1/.claude" and env["HOME"] == PATHS.home
    assert env["TMPDIR"] == env["CLAUDE_CODE_TMPDIR"] == "/home/agent/members/m1/tmp"
    for name in ("CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC", "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS",
                 "CLAUDE_CODE_EMIT_SESSION_STATE_EVENTS", "DISABLE_AUTOUPDATER", "DISABLE_TELEMETRY",
                 "DISABLE_ERROR_REPORTING"):
        assert env[name] == "1"
    assert env["CLAUDE_CODE_MAX_RETRIES"] == "2" and "IS_SANDBOX" not in env
    # SPEC 7: the key Claude holds is the sandbox's placeholder, in its plain env only
    assert env[KEY_ENV] == KEY and not hasattr(spec, "secret_env")
    assert KEY not in json.dumps(spec.argv) + json.dumps([f.content for f in spec.files])
    assert KEY not in " ".join(spec.launcher_argv(pidfile="/run/p"))
    assert set(spec.dirs) >= {PATHS.home, PATHS.workspace, PATHS.run_dir, env["TMPDIR"], env["CLAUDE_CONFIG_DIR"]}
    assert ClaudeDriver().plan(PATHS, GW, None).expected != launch.expected


def test_settings_change_the_launch() -> None:
    d = ClaudeDriver(ClaudeSettings(max_retries=0, state_events=False, path="/opt/bin", binary="/opt/bin/claude"))
    spec = d.plan(PATHS, GW, None).spec
    assert spec.env["CLAUDE_CODE_MAX_RETRIES"] == "0" and spec.env["PATH"] == "/opt/bin"
    assert "CLAUDE_CODE_EMIT_SESSION_STATE_EVENTS" not in spec.env and spec.argv[0] == "/opt/bin/claude"


def test_restored_launch_resumes_from_the_original_cwd_behind_a_precheck() -> None:
    d = ClaudeDriver()
    launch = d.plan(PATHS, GW, Locator(id=SID))
    assert launch.resume is True and launch.expected == Locator(id=SID)
    assert _flag(launch.spec.argv, "--resume") == SID and "--session-id" not in launch.spec.argv
    assert launch.spec.cwd == PATHS.workspace
    transcript = f"/home/agent/members/m1/.claude/projects/-home-agent-workspace/{SID}.jsonl"
    assert launch.spec.require_files == [transcript] == [d.transcript(PATHS, Locator(id=SID))]
    assert launch.spec.launcher_argv(pidfile="/p")[:7] == ["ca-launch", "--pidfile", "/p", "--cwd", PATHS.workspace,
                                                           "--require-file", transcript]


def test_a_hostile_locator_cannot_escape_the_projects_dir() -> None:
    launch = ClaudeDriver().plan(PATHS, GW, Locator(id="../../../etc/passwd"))
    (path,) = launch.spec.require_files
    assert path.startswith("/home/agent/members/m1/.claude/projects/-home-agent-workspace/") and ".." not in path
    assert _flag(launch.spec.argv, "--resume") == "_________etc_passwd"


def test_fork_whole_history() -> None:
    launch = ClaudeDriver().plan_fork(PATHS, GW, Locator(id=SID), None)
    argv = launch.spec.argv
    assert argv[0] == "claude" and _flag(argv, "--resume") == SID and "--fork-session" in argv
    assert _flag(argv, "--session-id") == launch.expected.id != SID and launch.resume is True
    assert "--resume-session-at" not in argv and launch.spec.files == []
    assert launch.spec.require_files == [ClaudeDriver().transcript(PATHS, Locator(id=SID))]


def test_fork_at_a_turn_goes_through_the_resolver() -> None:
    d = ClaudeDriver()
    launch = d.plan_fork(PATHS, GW, Locator(id=SID), 2)
    argv = launch.spec.argv
    resolver = f"/run/m1/{FORK_RESOLVER}"
    assert argv[:6] == ["python3", resolver, "--transcript", d.transcript(PATHS, Locator(id=SID)), "--turn", "2"]
    assert argv[6] == "--" and argv[7] == "claude" and "--fork-session" in argv
    (file,) = launch.spec.files
    assert file.path == resolver and "def fork_anchor" in file.content and KEY not in file.content
    with pytest.raises(ValueError):
        d.plan_fork(PATHS, GW, Locator(id=SID), 0)


def test_fork_at_an_explicit_message() -> None:
    launch = ClaudeDriver().plan_fork(PATHS, GW, Locator(id=SID), 3, at_message="abc-uuid")
    assert _flag(launch.spec.argv, "--resume-session-at") == "abc-uuid" and launch.spec.files == []


# ---------------------------------------------------------------- the resolver, on a real transcript


def _entries() -> list[dict]:
    return [json.loads(line) for line in TRANSCRIPT.read_text().splitlines()]


def _answer_to(prompt: str) -> str:
    """uuid of the last assistant entry before the prompt after ``prompt`` (by hand)."""
    entries = _entries()
    start = next(i for i, e in enumerate(entries) if e.get("type") == "user" and
                 (e["message"]["content"] == prompt or e["message"]["content"][:1] == [{"type": "text", "text": prompt}]))
    last = None
    for e in entries[start + 1:]:
        if is_prompt(e):
            break
        if e.get("type") == "assistant":
            last = e["uuid"]
    assert last
    return last


def test_recorded_transcript_prompts() -> None:
    prompts = [e for e in _entries() if is_prompt(e)]
    assert len(prompts) == 6  # a failed turn and a slash-looking one count; tool results do not


@pytest.mark.parametrize(("turn", "prompt"), [(1, "plain first"), (2, "FAILME now"), (3, "run it please"),
                                              (4, "delegate this"), (5, "/help"), (6, "plain last")])
def test_fork_anchor(turn: int, prompt: str) -> None:
    assert fork_anchor(TRANSCRIPT.read_text().splitlines(), turn) == _answer_to(prompt)


def test_fork_anchor_missing_and_garbage() -> None:
    lines = TRANSCRIPT.read_text().splitlines()
    assert fork_anchor(lines, 7) is None
    assert fork_anchor(["not json", "[]", '{"type":"user"}'], 1) is None
    unanswered = [*lines, json.dumps({"type": "user", "uuid": "u-x", "message": {"content": "no answer yet"}})]
    assert fork_anchor(unanswered, 7) is None


def test_resolver_script_execs_with_the_anchor_or_prints_launch_error(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parents[2] / "drivers" / "claude" / "fork_at.py"
    ok = subprocess.run([sys.executable, str(script), "--transcript", str(TRANSCRIPT), "--turn", "3", "--",
                         "echo", "claude", "--fork-session"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0 and ok.stdout.split() == ["claude", "--fork-session", "--resume-session-at",
                                                        _answer_to("run it please")]
    for args, reason in ((["--transcript", str(TRANSCRIPT), "--turn", "9"], "fork_point_missing"),
                         (["--transcript", str(tmp_path / "none.jsonl"), "--turn", "1"], "missing_file"),
                         (["--turn", "x"], "usage")):
        bad = subprocess.run([sys.executable, str(script), *args, "--", "echo"], capture_output=True, text=True,
                             timeout=30)
        assert bad.returncode == 3 and json.loads(bad.stdout) == {**json.loads(bad.stdout), "type": "launch_error",
                                                                   "reason": reason}
