"""The Claude driver against the real pinned Claude Code 2.1.220 inside the pinned image.

Every test runs ``claude -p`` stream-json in a container (sealed: network none, the model through its socket and a proxy in front of the in-process loopback fixture, user ``agent`` = uid 1000) through
``ca-launch`` and ``docker exec -i``, with member paths bind-mounted at the same absolute
path. What the model saw is asserted on the fixture's recorded requests.

``CLAUDE_CAPTURE=1`` also runs :func:`test_capture_streams`, which rewrites the recorded
wire streams under tests/data/claude/ that the unit tests replay.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.cli.driver_harness import DriverBox, box_fixtures, ok

from deploy.loopback import LoopbackFixture, Message, default_reply, fail, reject, shell_call, stall, tool_call
from deploy.loopback.behaviour import TERMINAL_MESSAGE
from drivers.base import parse_json_line
from drivers.claude import ClaudeDriver, ClaudeSession, ClaudeSettings
from drivers.claude.wire import sanitize_project_dir
from drivers.models import (
    DriverOptions,
    FailureReason,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    NotSettled,
    NotSettledReason,
    RetryNotice,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from drivers.transport import Transport, TransportWrapper
from tests.support.recording_shape import claude_kind, compare, stream_kinds

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

KEY = "sk-ant-claude-fixture-canary-7c1f3a"
MODEL = "fixture-model"
VERSION = "2.1.220"
DATA = Path(__file__).resolve().parents[1] / "data" / "claude"
SETTINGS = ClaudeSettings(max_retries=2, handshake_timeout_s=60.0, interrupt_grace_s=5.0)
AGENT_INPUT = {"description": "child task", "prompt": "CHILD do the work", "subagent_type": "general-purpose"}
OTHER = "99999999-aaaa-4bbb-8ccc-dddddddddddd"  # a session id no CLI here ever minted


# ---------------------------------------------------------------- harness


class Box(DriverBox):
    key = KEY
    api = "anthropic"
    shared_workspace = True

    def __init__(self, container: Any, root: Path, fx: LoopbackFixture, name: str) -> None:
        super().__init__(container, root, fx, name)
        self.driver = ClaudeDriver(SETTINGS)

    async def start(self, paths: MemberPaths, resume: Locator | None = None, *,
                    log: list[tuple[str, bytes]] | None = None, launch: Any = None) -> ClaudeSession:
        launch = launch or self.driver.plan(paths, self.gateway, resume)
        transport = await self.launch(launch.spec, paths, log)
        return self.driver.session(transport, launch)

    def model_requests(self) -> list[Any]:
        return [r for r in self.fx.requests() if r.method == "POST"]

    def last_user_block(self) -> str:
        """The exact text of the last user content block the model received."""
        body = self.fx.conversation_requests(api="anthropic")[-1].body
        user = [m for m in body["messages"] if m["role"] == "user"][-1]
        content = user["content"]
        return content if isinstance(content, str) else [b for b in content if b.get("type") == "text"][-1]["text"]


root, container, box = box_fixtures("claude", Box)


async def wait_flushed(transcript: Path, needle: str, timeout_s: float = 5.0) -> None:
    """2.1.220 appends to the transcript asynchronously: observed up to ~80 ms AFTER the
    result and idle lines. Only a graceful exit (stdin EOF) guarantees the flush."""
    with anyio.fail_after(timeout_s):
        while not (transcript.is_file() and needle in transcript.read_text(errors="replace")):
            await anyio.sleep(0.01)


async def new_session(box: Box, paths: MemberPaths | None = None, **kw: Any) -> ClaudeSession:
    s = await box.start(paths or box.member("m"), **kw)
    await s.handshake()
    return s


# ---------------------------------------------------------------- NEW / LIVE / RESTORED


async def test_new_live_restored_history(box: Box) -> None:
    paths = box.member("m")
    s = await new_session(box, paths)
    assert s.expected is not None and s.locator is None
    events: list[Any] = []
    u1, u2, u3 = "first question alpha", "second question beta", "third question gamma"
    r1 = ok(await s.run_turn(u1, emit=events.append, timeout_s=60))
    a1 = default_reply([u1])
    assert r1.assistant_text == a1 and r1.retire_after is False
    assert r1.observed_locator == s.expected == s.locator
    assert s.cli_version == VERSION
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == a1
    assert box.dialogue() == [Message.user(u1)]
    req = box.fx.last()
    assert req.headers.get("x-claude-code-session-id") == s.expected.id and req.body["model"] == MODEL

    r2 = ok(await s.run_turn(u2, timeout_s=60))  # LIVE
    a2 = default_reply([u1, u2])
    assert r2.assistant_text == a2
    assert box.dialogue() == [Message.user(u1), Message.assistant(a1), Message.user(u2)]

    await box.kill(s)
    transcript = Path(box.driver.transcript(paths, s.expected))
    assert transcript.is_file() and transcript.parent.name == sanitize_project_dir(paths.workspace)
    s2 = await box.start(paths, resume=r2.observed_locator)  # RESTORED
    await s2.handshake()
    r3 = ok(await s2.run_turn(u3, timeout_s=60))
    assert r3.observed_locator == r2.observed_locator == s2.locator
    assert box.dialogue() == [Message.user(u1), Message.assistant(a1), Message.user(u2), Message.assistant(a2),
                              Message.user(u3)]
    # the only non-model request is 2.1.220's preconnect HEAD /api/hello, once per process
    assert {(r.method, r.path) for r in box.fx.requests() if r.method != "POST"} <= {("HEAD", "/api/hello")}
    assert len(box.model_requests()) == 3
    assert await box.stop(s2) == 0


async def test_long_workspace_path_uses_the_hashed_project_dir(box: Box) -> None:
    deep = box.root / ("w.dot_und er-" + "x" * 60) / ("y" * 80) / ("z" * 70)
    paths = box.member("m", workspace=str(deep))
    assert len(sanitize_project_dir(str(deep))) > 200
    s = await new_session(box, paths)
    ok(await s.run_turn("hello from a deep cwd", timeout_s=60))
    transcript = Path(box.driver.transcript(paths, s.expected))
    await wait_flushed(transcript, "hello from a deep cwd")
    await box.kill(s)
    s2 = await box.start(paths, resume=s.expected)
    await s2.handshake()
    ok(await s2.run_turn("and again", timeout_s=60))


async def test_resume_of_an_unknown_locator_is_refused_without_model_requests(box: Box) -> None:
    s = await box.start(box.member("m"), resume=Locator(id="0b9c1a5e-1111-4222-8333-444455556666"))
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING, exc.value
    assert box.fx.requests() == []  # the launcher precheck: the CLI never started


async def test_resume_refused_by_the_cli_itself(box: Box) -> None:
    """Without the launcher precheck the CLI's own answer is an error result + exit 1."""
    paths = box.member("m")
    launch = box.driver.plan(paths, box.gateway, Locator(id="0b9c1a5e-1111-4222-8333-444455556666"))
    unchecked = launch.model_copy(update={"spec": launch.spec.model_copy(update={"require_files": []})})
    s = await box.start(paths, launch=unchecked)
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING
    assert "No conversation found" in exc.value.detail
    assert box.model_requests() == []  # at most the preconnect HEAD


async def test_resume_from_another_cwd_is_native_state_missing(box: Box) -> None:
    paths = box.member("m")
    s = await new_session(box, paths)
    r = ok(await s.run_turn("remember me", timeout_s=60))
    await box.kill(s)
    moved = paths.model_copy(update={"workspace": str(box.root / "elsewhere")})
    s2 = await box.start(moved, resume=r.observed_locator)
    with pytest.raises(HandshakeFailed) as exc:
        await s2.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING
    assert len(box.model_requests()) == 1


# ---------------------------------------------------------------- retries and failures


@pytest.mark.parametrize("status", [529, 500])
async def test_transient_error_is_retried_and_retires_the_process(box: Box, status: int) -> None:
    box.fx.add_rules(fail(status, match="flaky", times=1))
    paths = box.member("m")
    s = await new_session(box, paths)
    events: list[Any] = []
    u1, u2 = "flaky question", "after the flake"
    r1 = ok(await s.run_turn(u1, emit=events.append, timeout_s=60))
    assert r1.retire_after is True  # SPEC 6: the retry defect -> commit, then retire
    retries = [e for e in events if isinstance(e, RetryNotice)]
    assert [(e.attempt, e.status) for e in retries] == [(1, status)]
    assert r1.assistant_text == default_reply([u1])
    assert [r.status for r in box.fx.conversation_requests()] == [status, 200]
    assert box.dialogue(0) == box.dialogue(1) == [Message.user(u1)]
    # the runner retires the process and the next turn is RESTORED with the history intact
    assert await box.stop(s) == 0
    s2 = await box.start(paths, resume=r1.observed_locator)
    await s2.handshake()
    r2 = ok(await s2.run_turn(u2, timeout_s=60))
    assert r2.retire_after is False
    assert box.dialogue() == [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(u2)]


@pytest.mark.parametrize(("rule", "reason", "needle"), [
    # anchored: the follow-up's merged text "FAILME now" + u3 must not be rejected again
    (reject(match="^FAILME now$", regex=True), FailureReason.API_ERROR, TERMINAL_MESSAGE),
    (reject(match="^FAILME now$", regex=True, context_window=True), FailureReason.CONTEXT_TOO_LONG, "too long"),
])
async def test_terminal_400_is_a_settled_failure_and_history_survives(box: Box, rule, reason, needle) -> None:
    box.fx.add_rules(rule)
    s = await new_session(box)
    u1, u2, u3 = "good start", "FAILME now", "after the failure"
    r1 = ok(await s.run_turn(u1, timeout_s=60))
    r2 = await s.run_turn(u2, timeout_s=60)
    assert isinstance(r2, Settlement) and r2.is_error, r2
    assert r2.reason is reason and needle in (r2.detail or ""), r2
    assert r2.observed_locator == r1.observed_locator == s.locator
    assert r2.raw[0]["api_error_status"] == 400
    r3 = ok(await s.run_turn(u3, timeout_s=60))
    # The CLI keeps the failed query and sends it merged with the next one: one API user
    # message whose blocks are u2 + "\n" (the CLI adds the newline) and u3; the audit joins
    # blocks with "".
    merged = u2 + "\n" + u3
    assert box.dialogue() == [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(merged)]
    assert r3.assistant_text == default_reply([u1, merged])


# ---------------------------------------------------------------- interrupt / timeout / cancel / death


async def test_timeout_interrupts_then_not_settled_and_the_process_stays_usable(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL", times=1))
    s = await new_session(box)
    r = await s.run_turn("STALL forever", timeout_s=4)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.TIMEOUT, r
    tracker = s.last_tracker
    assert s.quiesced and tracker is not None and tracker.result is not None
    assert tracker.result["terminal_reason"] == "aborted_streaming"
    # The runner retires the process (SPEC 5); the CLI itself would take the next message:
    r2 = ok(await s.run_turn("after the interrupt", timeout_s=60))
    assert r2.observed_locator == s.expected
    # the interrupted query stays in the native history, merged with a marker and the next one
    assert box.dialogue() == [Message.user("STALL forever\n[Request interrupted by user]\nafter the interrupt")]


async def test_cancellation_interrupts_and_reraises(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL", times=1))
    s = await new_session(box)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_soon() -> None:
                await box.until_stalled()
                scope.cancel()
            tg.start_soon(cancel_soon)
            await s.run_turn("STALL then cancel", timeout_s=60)
            pytest.fail("run_turn returned after cancellation")
    assert scope.cancelled_caught
    # The interrupt went out: the CLI ends the turn as aborted and stays usable. The aborted
    # turn's unread result must not be taken for the next turn's.
    r = ok(await s.run_turn("after cancel", timeout_s=60))
    assert s.last_tracker is not None and s.last_tracker.stale_results == 1
    assert box.dialogue() == [Message.user("STALL then cancel\n[Request interrupted by user]\nafter cancel")]
    assert r.assistant_text == default_reply(["STALL then cancel\n[Request interrupted by user]\nafter cancel"])


async def test_process_death_mid_turn_is_transport_closed(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL", times=1))
    s = await new_session(box)
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def turn() -> None:
            result.append(await s.run_turn("STALL then die", timeout_s=60))
        tg.start_soon(turn)
        await box.until_stalled()
        await box.kill(s)
    assert isinstance(result[0], NotSettled) and result[0].reason is NotSettledReason.TRANSPORT_CLOSED


# ---------------------------------------------------------------- message fidelity, tools, child agents


MESSAGES = [
    "first paragraph\n\nsecond paragraph\n\n- a list item\n- another",
    "中文消息：我刚才让你做什么了？",
    "emoji 🚀👩‍💻 and ZWJ sequences 🏳️‍🌈",
    "   leading and trailing whitespace \t\n\n  ",
    '{"type": "user", "message": {"role": "user", "content": "json-looking"}, "session_id": "x"}',
    "/help",
    "/clear",
    "/compact please",
    "/nonexistent-cmd with args",
]


async def test_message_is_sent_unchanged(box: Box) -> None:
    s = await new_session(box)
    for text in MESSAGES:
        r = ok(await s.run_turn(text, timeout_s=60))
        assert box.last_user_block() == text
        assert r.observed_locator == s.expected  # "/clear" would have started a new session
        assert r.assistant_text == default_reply([m.text for m in box.dialogue() if m.role == "user"])
    assert len(box.model_requests()) == len(MESSAGES)


async def test_raw_slash_clear_would_switch_sessions_and_is_reported(box: Box, monkeypatch) -> None:
    """Why slash-looking text gets the trailing empty block: sent as a plain string, "/clear"
    is run by the CLI and the turn reports a NEW session id. The driver surfaces it."""
    import drivers.claude.wire as claude_module

    def plain(message: str) -> dict[str, Any]:
        return {"type": "user", "message": {"role": "user", "content": message}, "parent_tool_use_id": None,
                "session_id": ""}

    s = await new_session(box)
    ok(await s.run_turn("before", timeout_s=60))
    monkeypatch.setattr(claude_module, "user_line", plain)
    r = await s.run_turn("/clear", timeout_s=60)
    assert isinstance(r, Settlement) and r.observed_locator is not None
    assert r.observed_locator != s.expected  # the runner fails this turn: identity_mismatch
    assert len(box.model_requests()) == 1  # "/clear" never reached the model


async def test_new_session_id_already_in_use_is_process_failed(box: Box) -> None:
    paths = box.member("m")
    s = await new_session(box, paths)
    ok(await s.run_turn("take the id", timeout_s=60))
    await box.stop(s)
    again = await box.start(paths, launch=s.launch)
    with pytest.raises(HandshakeFailed) as exc:
        await again.handshake()
    assert exc.value.reason is HandshakeReason.PROCESS_FAILED and "already in use" in exc.value.detail


async def test_tool_events(box: Box) -> None:
    box.fx.add_rules(shell_call("echo marker-$((6*7)) && touch made-by-claude", match="run it", then_reply="ran it"))
    log: list[tuple[str, bytes]] = []
    paths = box.member("m")
    s = await new_session(box, paths, log=log)
    events: list[Any] = []
    r = ok(await s.run_turn("run it please", emit=events.append, timeout_s=60))
    assert r.assistant_text == "ran it"
    # uid 1000 + bypassPermissions (no IS_SANDBOX): the write went through, no prompt, no denial
    init = next(json.loads(line) for d, line in log if b'"subtype":"init"' in line)
    assert init["permissionMode"] == "bypassPermissions" and init["claude_code_version"] == VERSION
    assert (Path(paths.workspace) / "made-by-claude").is_file()
    assert r.raw[0]["permission_denials"] == []
    started = [e for e in events if isinstance(e, ToolStarted)]
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert [e.tool for e in started] == ["Bash"]
    assert finished and finished[0].call_id == started[0].call_id and "marker-42" in (finished[0].output or "")


class ChildIdRewriter(TransportWrapper):
    """On the real stream, gives every child-agent event (``parent_tool_use_id`` set) another
    session id. 2.1.220's child events carry the root's id, so without this a driver that took
    the session id from child events would pass unnoticed."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.rewritten: list[str] = []  # the types of the child events given OTHER's id

    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        obj = parse_json_line(line) if line is not None else None
        if obj is not None and obj.get("parent_tool_use_id") is not None and "session_id" in obj:
            self.rewritten.append(str(obj.get("type")))
            return json.dumps({**obj, "session_id": OTHER}).encode()
        return line


async def test_child_agent_runs_in_the_foreground_and_cannot_touch_the_locator(box: Box) -> None:
    box.fx.add_rules(tool_call("Agent", AGENT_INPUT, match="delegate", then_reply="parent done"),
                     shell_call("echo from-child", match="CHILD", kinds=["subagent"], then_reply="child done", times=1))
    paths = box.member("m")
    launch = box.driver.plan(paths, box.gateway, None)
    rewriter = ChildIdRewriter(await box.launch(launch.spec, paths))
    s = box.driver.session(rewriter, launch)
    await s.handshake()
    events: list[Any] = []
    r = ok(await s.run_turn("delegate this", emit=events.append, timeout_s=90))
    # child events reported another session; only root events may set the locator (SPEC 4.4)
    assert "assistant" in rewriter.rewritten and "user" in rewriter.rewritten, rewriter.rewritten
    assert r.assistant_text == "parent done" and r.observed_locator == s.expected == s.locator
    tracker = s.last_tracker
    assert tracker is not None and tracker.mismatch_id is None and tracker.first_root_id == s.expected.id
    assert tracker.started_tasks and tracker.started_tasks == tracker.finished_tasks
    assert tracker.early_idles == 0  # foreground subagents: idle only after everything
    assert [e.tool for e in events if isinstance(e, ToolStarted)] == ["Agent"]
    assert any(getattr(e, "name", "") == "subagent.tool_started" for e in events)
    assert {r.kind for r in box.fx.requests(api="anthropic")} == {"conversation", "subagent"}


# ---------------------------------------------------------------- fork


async def test_fork_whole_history_and_at_a_turn(box: Box) -> None:
    paths = box.member("m")
    s = await new_session(box, paths)
    u = ["fork one", "fork two", "fork three"]
    answers = []
    for i, text in enumerate(u):
        answers.append(ok(await s.run_turn(text, timeout_s=60)).assistant_text)
        assert answers[-1] == default_reply(u[: i + 1])
    anchor_two = None
    parent = s.expected
    await box.stop(s)
    parent_file = Path(box.driver.transcript(paths, parent))
    before = parent_file.read_bytes()

    full = box.driver.plan_fork(paths, box.gateway, parent, None)
    f1 = await box.start(paths, launch=full)
    await f1.handshake()
    r = ok(await f1.run_turn("branch A", timeout_s=60))
    assert r.observed_locator == full.expected != parent
    hist = [Message.user(u[0]), Message.assistant(answers[0]), Message.user(u[1]), Message.assistant(answers[1]),
            Message.user(u[2]), Message.assistant(answers[2])]
    assert box.dialogue() == [*hist, Message.user("branch A")]
    await box.stop(f1)

    at2 = box.driver.plan_fork(paths, box.gateway, parent, 2)
    f2 = await box.start(paths, launch=at2)
    await f2.handshake()
    r = ok(await f2.run_turn("branch B", timeout_s=60))
    assert r.observed_locator == at2.expected
    assert box.dialogue() == [*hist[:4], Message.user("branch B")]
    anchor_two = f2.last_assistant_uuid
    await box.stop(f2)

    at1 = box.driver.plan_fork(paths, box.gateway, parent, 1)
    f3 = await box.start(paths, launch=at1)
    await f3.handshake()
    ok(await f3.run_turn("branch C", timeout_s=60))
    assert box.dialogue() == [*hist[:2], Message.user("branch C")]
    await box.stop(f3)

    # the fork of a fork, at an explicit message uuid (the last answer in branch B)
    at_msg = box.driver.plan_fork(paths, box.gateway, at2.expected, None, at_message=anchor_two)
    f4 = await box.start(paths, launch=at_msg)
    await f4.handshake()
    ok(await f4.run_turn("branch D", timeout_s=60))
    assert box.dialogue() == [*hist[:4], Message.user("branch B"), Message.assistant(default_reply([u[0], u[1], "branch B"])),
                              Message.user("branch D")]
    await box.stop(f4)

    assert parent_file.read_bytes() == before  # forks never touch the parent's transcript
    n = len(box.model_requests())
    too_far = box.driver.plan_fork(paths, box.gateway, parent, 9)
    f5 = await box.start(paths, launch=too_far)
    with pytest.raises(HandshakeFailed) as exc:
        await f5.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING and "fork_point_missing" in exc.value.detail
    assert len(box.model_requests()) == n


# ---------------------------------------------------------------- recorded streams for the unit tests


CAPTURE = os.environ.get("CLAUDE_CAPTURE") == "1"
# CLAUDE_CAPTURE=1 rewrites the committed streams; otherwise every run still drives the same
# real scenarios (a CLI that stopped behaving fails here) and writes them to a temp dir.
CAPTURE_DIR = DATA if CAPTURE else Path(tempfile.mkdtemp(prefix="claude-capture-"))


def _trim(obj: dict[str, Any]) -> dict[str, Any]:
    """Shrink a recorded object without changing its protocol meaning."""
    out = dict(obj)
    if out.get("type") == "system" and out.get("subtype") == "init":
        for key in ("tools", "slash_commands", "skills", "plugins", "agents", "mcp_servers", "memory_paths"):
            if isinstance(out.get(key), list):
                out[key] = out[key][:3]
    if out.get("type") == "control_response":
        resp = dict(out.get("response") or {})
        inner = resp.get("response")
        if isinstance(inner, dict):
            resp["response"] = {k: (v[:2] if isinstance(v, list) else v) for k, v in inner.items()}
        out["response"] = resp
    if out.get("type") == "user" and isinstance(out.get("tool_use_result"), dict):
        out["tool_use_result"] = {k: v for k, v in out["tool_use_result"].items() if k != "content"}
    return out


def _write(name: str, log: list[tuple[str, bytes]], expected: Locator | None, note: str) -> None:
    CAPTURE_DIR.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"scenario": name, "cli_version": VERSION, "expected": expected.id if expected else None,
                         "note": note}, ensure_ascii=False)]
    for direction, raw in log:
        try:
            obj = json.loads(raw)
        except ValueError:
            lines.append(json.dumps({"d": direction, "raw": raw.decode(errors="replace")}))
            continue
        lines.append(json.dumps({"d": direction, "o": _trim(obj) if direction == "recv" else obj}, ensure_ascii=False))
    (CAPTURE_DIR / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


# Telemetry-like lines whose position races the turn's own lines: they only have to occur.
def _unordered(kind: str) -> bool:
    return kind.startswith(("recv system/status", "recv rate_limit_event", "recv system/hook"))


# Whether the background child's own ``sleep 3`` Bash becomes a ``local_bash`` task of its own
# (a task_started without the agent's prompt, and its task_notification without usage) races
# the parent's result: the committed run has it, a CI run under load (2.1.220) had not. The
# agent's task_started/task_notification, which the driver waits on, stay compared.
_CHILD_BASH_TASK = {
    "recv system/task_started [description,session_id,subtype,task_id,task_type,tool_use_id,type,uuid]",
    "recv system/task_notification [output_file,session_id,status,subtype,summary,task_id,tool_use_id,type,uuid]",
}
_IGNORED = {"background_origin": _CHILD_BASH_TASK}


# A background child runs beside its parent: where its events (and its progress reports) fall
# among the parent's lines is a race of one run, not protocol — a CI run under load had the
# parent's assistant line and result before the child's first event, the committed run after.
# They still have to occur; the parent's own lines stay compared in order.
def _unordered_background(kind: str) -> bool:
    return _unordered(kind) or "(child)" in kind or kind.startswith("recv system/task_progress")


_UNORDERED = {"background_origin": _unordered_background}


def _shape_problems(names: list[str]) -> list[str]:
    """A fresh capture against the committed recording of each scenario (ids, timestamps and the
    number of text deltas aside: tests/support/recording_shape.py)."""
    if CAPTURE:
        return []
    problems = []
    for name in names:
        fresh = stream_kinds(CAPTURE_DIR / f"{name}.jsonl", claude_kind)
        committed = stream_kinds(DATA / f"{name}.jsonl", claude_kind)
        ignored = _IGNORED.get(name, set())
        problems += [f"{name}: {p}" for p in compare(fresh, committed, unordered=_UNORDERED.get(name, _unordered),
                                                         ignored=ignored.__contains__)]
    return problems


async def test_capture_streams(box: Box) -> None:
    box.fx.add_rules(
        fail(529, match="flaky", times=1),
        reject(match="^FAILME now$", regex=True),
        reject(match="^HUGE prompt$", regex=True, context_window=True),
        tool_call("Agent", AGENT_INPUT, match="delegate", then_reply="parent done"),
        shell_call("echo from-child", match="CHILD", kinds=["subagent"], then_reply="child done", times=1),
        shell_call("echo marker-$((6*7))", match="run it", then_reply="ran it"),
        stall(30, match="STALL", times=1),
    )
    paths = box.member("m")
    scenarios = [
        ("success", ["hello there"], "NEW: handshake, one plain turn"),
        ("failure_400", ["FAILME now"], "terminal 400: result subtype success, is_error true"),
        ("context_400", ["HUGE prompt"], "context-window 400: reactive compaction, then prompt_too_long"),
        ("retry", ["flaky question"], "one 529, api_retry, then success"),
        ("tool", ["run it please"], "a root Bash tool call"),
        ("child_agent", ["delegate this"], "foreground Agent tool: child events with parent_tool_use_id"),
        ("slash", ["/help"], "a slash-looking message, delivered to the model unchanged"),
        ("live", ["first of two", "second of two"], "LIVE: two turns on one resident process"),
    ]
    for name, messages, note in scenarios:
        log: list[tuple[str, bytes]] = []
        # the recorded reactive compaction is what the replay tests read: this scenario runs with
        # native compaction on (the default, off, refuses without a summary request)
        driver = ClaudeDriver(SETTINGS, options=DriverOptions(native_compaction=True)) if name == "context_400" \
            else box.driver
        s = await box.start(box.member(name), log=log,
                            launch=driver.plan(box.member(name), box.gateway, None))
        await s.handshake()
        for text in messages:
            assert isinstance(await s.run_turn(text, timeout_s=90), Settlement)
        await box.stop(s)
        _write(name, log, s.expected, note)

    log = []
    s = await box.start(paths, log=log)
    await s.handshake()
    r = await s.run_turn("STALL forever", timeout_s=3)
    assert isinstance(r, NotSettled)
    await box.stop(s)
    _write("interrupt", log, s.expected, "timeout: control interrupt, aborted_streaming result, idle")

    log = []
    s = await box.start(paths, resume=s.expected, log=log)
    await s.handshake()
    ok(await s.run_turn("resumed turn", timeout_s=60))
    await box.stop(s)
    _write("restored", log, s.expected, "RESTORED: --resume after an interrupted turn")

    log = []
    unknown = box.driver.plan(paths, box.gateway, Locator(id="0b9c1a5e-1111-4222-8333-444455556666"))
    unchecked = unknown.model_copy(update={"spec": unknown.spec.model_copy(update={"require_files": []})})
    s = await box.start(paths, launch=unchecked, log=log)
    with pytest.raises(HandshakeFailed):
        await s.handshake()
    _write("resume_unknown", log, unknown.expected, "--resume of an unknown id: error result, exit 1")

    # Background subagents (the CLI default, here re-enabled) produce a task-notification
    # turn whose result carries "origin": the shape the driver must ignore.
    # the child outlives the parent's result (sleep), which is what makes 2.1.220 say idle early
    box.fx.add_rules(shell_call("sleep 3; echo from-bg-child", match="CHILD", kinds=["subagent"],
                                then_reply="bg child done", times=1))
    log = []
    bg = box.driver.plan(box.member("background"), box.gateway, None)
    env = {k: v for k, v in bg.spec.env.items() if k != "CLAUDE_CODE_DISABLE_BACKGROUND_TASKS"}
    bg = bg.model_copy(update={"spec": bg.spec.model_copy(update={"env": env})})
    t = await box.launch(bg.spec, box.member("background"), log)
    s = box.driver.session(t, bg)
    await s.handshake()
    # settles only after the early idle, the child's events, the origin turn and the last idle
    r = ok(await s.run_turn("delegate this", timeout_s=90))
    assert s.last_tracker is not None and s.last_tracker.ignored_results >= 1
    await box.stop(s)
    _write("background_origin", log, s.expected,
           "background tasks ENABLED: early idle, child events after the result, origin result")

    # A transcript with every kind of turn, for the fork-point resolver's unit tests.
    box.fx.add_rules(shell_call("echo from-child", match="CHILD", kinds=["subagent"], then_reply="child done",
                                times=1))
    paths = box.member("transcript")
    s = await box.start(paths)
    await s.handshake()
    for text in ("plain first", "FAILME now", "run it please", "delegate this", "/help", "plain last"):
        assert isinstance(await s.run_turn(text, timeout_s=90), Settlement)
    assert await box.stop(s) == 0
    entries = []
    for line in Path(box.driver.transcript(paths, s.expected)).read_text().splitlines():
        entry = json.loads(line)
        if entry.get("type") == "attachment":
            entry["attachment"] = {"type": entry.get("attachment", {}).get("type"), "trimmed": True}
        entries.append(json.dumps(entry, ensure_ascii=False))
    (CAPTURE_DIR / "transcript.jsonl").write_text("\n".join(entries) + "\n")
    recorded = [name for name, _, _ in scenarios] + ["interrupt", "restored", "resume_unknown", "background_origin"]
    assert sorted(recorded) == sorted(p.stem for p in DATA.glob("*.jsonl") if p.stem != "transcript")
    problems = _shape_problems(recorded)
    assert not problems, "the real CLI no longer produces the committed streams (re-record with " \
                         "CLAUDE_CAPTURE=1 once understood):\n" + "\n".join(problems)
