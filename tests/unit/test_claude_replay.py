"""The Claude driver over REAL recorded 2.1.220 streams (tests/data/claude/, captured by
``CLAUDE_CAPTURE=1 pytest tests/cli/test_claude_driver.py -k capture``), replayed by a
scripted fake transport; crafted variants are derived from the recorded shapes."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from drivers.base import Launch
from drivers.claude import ClaudeSession, ClaudeSettings
from drivers.launch import LaunchSpec
from drivers.models import (
    ErrorNotice,
    FailureReason,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    Notice,
    NotSettled,
    NotSettledReason,
    RetryNotice,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from tests.support.claude_replay import ScriptedTransport, Step

DATA = Path(__file__).resolve().parents[1] / "data" / "claude"
SETTINGS = ClaudeSettings(persist_grace_s=0, handshake_timeout_s=5, interrupt_grace_s=1)
OTHER = "99999999-aaaa-4bbb-8ccc-dddddddddddd"

def load_stream(name: str) -> tuple[dict[str, Any], list[Step]]:
    lines = (DATA / f"{name}.jsonl").read_text().splitlines()
    header = json.loads(lines[0])
    steps: list[Step] = []
    for line in lines[1:]:
        rec = json.loads(line)
        steps.append((rec["d"], rec["o"] if "o" in rec else rec["raw"].encode()))
    return header, steps


def make_session(steps: list[Step], expected: str | None, *, resume: bool = False,
                 settings: ClaudeSettings = SETTINGS, hold_open: bool = False) -> tuple[ClaudeSession, ScriptedTransport]:
    spec = LaunchSpec(runtime="claude", argv=["claude"], cwd="/w")
    launch = Launch(spec=spec, expected=Locator(id=expected) if expected else None, resume=resume)
    t = ScriptedTransport(steps, hold_open=hold_open)
    return ClaudeSession(t, launch, settings), t


def recv_objs(steps: list[Step]) -> list[dict[str, Any]]:
    return [o for d, o in steps if d == "recv" and isinstance(o, dict)]


async def replay(name: str, *, message: str = "hello", timeout_s: float = 5.0,
                 mutate: Any = None) -> tuple[Any, ClaudeSession, ScriptedTransport, list[Any]]:
    header, steps = load_stream(name)
    if mutate is not None:
        steps = mutate(copy.deepcopy(steps))
    s, t = make_session(steps, header["expected"])
    events: list[Any] = []
    with anyio.fail_after(10):
        await s.handshake()
        outcome = await s.run_turn(message, emit=events.append, timeout_s=timeout_s)
    return outcome, s, t, events


pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- recorded streams


async def test_success() -> None:
    out, s, t, events = await replay("success")
    assert isinstance(out, Settlement) and not out.is_error and out.reason is None
    assert out.evidence == "claude:result" and out.retire_after is False
    assert out.observed_locator == s.expected == s.locator
    assert out.assistant_text.startswith("ok 1: ")
    assert [e.text for e in events if isinstance(e, TextDelta)] == [out.assistant_text]
    assert s.cli_version == "2.1.220" and s.pid is not None and s.turns == 1
    assert t.sent_subtypes() == ["initialize"]  # no interrupt
    assert t.sent[1] == {"type": "user", "message": {"role": "user", "content": "hello"},
                         "parent_tool_use_id": None, "session_id": ""}
    assert out.raw[0]["type"] == "result" and s.last_assistant_uuid


async def test_live_two_turns() -> None:
    header, steps = load_stream("live")
    s, _ = make_session(steps, header["expected"])
    with anyio.fail_after(10):
        await s.handshake()
        r1 = await s.run_turn("one")
        r2 = await s.run_turn("two")
    assert isinstance(r1, Settlement) and isinstance(r2, Settlement)
    assert r1.assistant_text.startswith("ok 1: ") and r2.assistant_text.startswith("ok 2: ")
    assert r2.observed_locator == s.locator == s.expected and s.turns == 2


async def test_settled_failure_400() -> None:
    out, s, _, events = await replay("failure_400")
    assert isinstance(out, Settlement) and out.is_error and out.reason is FailureReason.API_ERROR
    assert "request rejected" in (out.detail or "")
    assert out.raw[0]["subtype"] == "success"  # judged by is_error, never subtype
    assert out.observed_locator == s.expected == s.locator  # a settled failure keeps the locator
    assert any(isinstance(e, ErrorNotice) for e in events)


async def test_context_400_is_context_too_long() -> None:
    out, *_ = await replay("context_400")
    assert isinstance(out, Settlement) and out.is_error and out.reason is FailureReason.CONTEXT_TOO_LONG
    assert out.raw[0]["terminal_reason"] == "prompt_too_long"


async def test_retry_sets_retire_after() -> None:
    out, _, _, events = await replay("retry")
    assert isinstance(out, Settlement) and not out.is_error and out.retire_after is True
    retries = [e for e in events if isinstance(e, RetryNotice)]
    assert [(e.attempt, e.status, e.detail) for e in retries] == [(1, 529, "overloaded")]


async def test_tool_events() -> None:
    out, _, _, events = await replay("tool")
    assert isinstance(out, Settlement) and out.assistant_text == "ran it"
    started = [e for e in events if isinstance(e, ToolStarted)]
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert [e.tool for e in started] == ["Bash"] and started[0].input["command"].startswith("echo marker")
    assert finished[0].call_id == started[0].call_id and "marker-42" in (finished[0].output or "")


async def test_child_agent_events() -> None:
    out, s, t, events = await replay("child_agent")
    assert isinstance(out, Settlement) and out.assistant_text == "parent done"
    assert out.observed_locator == s.expected
    # only the root Agent call is a tool of this turn; the child's Bash is a notice
    assert [e.tool for e in events if isinstance(e, ToolStarted)] == ["Agent"]
    assert [e.detail for e in events if isinstance(e, Notice) and e.name == "subagent.tool_started"] == ["Bash"]
    tracker = s.last_tracker
    assert tracker is not None and tracker.started_tasks == tracker.finished_tasks != set()
    assert t.sent_subtypes() == ["initialize"]


async def test_slash_message_is_sent_with_a_trailing_empty_block() -> None:
    out, _, t, _ = await replay("slash", message="/help")
    assert isinstance(out, Settlement) and out.assistant_text.startswith("ok 1: ")
    assert t.sent[1]["message"]["content"] == [{"type": "text", "text": "/help"}, {"type": "text", "text": ""}]


async def test_background_agent_early_idle_and_origin_result_are_not_settlement() -> None:
    out, s, _, _ = await replay("background_origin")
    assert isinstance(out, Settlement) and out.assistant_text == "parent done"
    tracker = s.last_tracker
    assert tracker is not None
    assert tracker.early_idles == 1  # 2.1.220 said idle while the background agent ran
    assert tracker.ignored_results == 1  # the task-notification turn's result has "origin"
    assert out.raw[0].get("origin") is None and out.observed_locator == s.expected


# ---------------------------------------------------------------- crafted from the recorded shapes


def _with_session(obj: dict[str, Any], sid: str) -> dict[str, Any]:
    return {**obj, "session_id": sid}


async def test_child_event_with_another_session_id_has_no_effect() -> None:
    def mutate(steps: list[Step]) -> list[Step]:
        return [(d, _with_session(o, OTHER) if d == "recv" and isinstance(o, dict) and o.get("parent_tool_use_id")
                 else o) for d, o in steps]

    out, s, t, _ = await replay("child_agent", mutate=mutate)
    assert isinstance(out, Settlement) and out.observed_locator == s.expected == s.locator
    assert t.sent_subtypes() == ["initialize"]


async def test_root_init_with_another_session_id_is_reported_and_interrupted() -> None:
    def mutate(steps: list[Step]) -> list[Step]:
        return [(d, _with_session(o, OTHER) if d == "recv" and isinstance(o, dict) and o.get("subtype") == "init"
                 else o) for d, o in steps]

    out, s, t, _ = await replay("success", mutate=mutate)
    assert isinstance(out, Settlement) and out.observed_locator == Locator(id=OTHER)
    assert s.locator is None  # never silently "corrected" to the expected id
    assert t.sent_subtypes() == ["initialize", "interrupt"]


async def test_crafted_root_event_mid_turn_with_another_session_id() -> None:
    def mutate(steps: list[Step]) -> list[Step]:
        out: list[Step] = []
        for d, o in steps:
            out.append((d, o))
            if d == "recv" and isinstance(o, dict) and o.get("subtype") == "task_started":
                out.append(("recv", {"type": "system", "subtype": "status", "status": None, "session_id": OTHER}))
        return out

    out, s, t, _ = await replay("child_agent", mutate=mutate)
    assert isinstance(out, Settlement) and out.observed_locator == Locator(id=OTHER)
    assert "interrupt" in t.sent_subtypes() and s.locator is None


async def test_origin_results_before_and_after_the_turn_result_are_ignored() -> None:
    _, bg = load_stream("background_origin")
    origin = next(o for o in recv_objs(bg) if o.get("type") == "result" and "origin" in o)

    def mutate(steps: list[Step]) -> list[Step]:
        out: list[Step] = []
        for d, o in steps:
            if d == "recv" and isinstance(o, dict) and o.get("type") == "result":
                out.append(("recv", {**origin, "is_error": True, "result": "stale notification"}))
            out.append((d, o))
        return out

    out, s, _, _ = await replay("success", mutate=mutate)
    assert isinstance(out, Settlement) and not out.is_error and out.assistant_text.startswith("ok 1: ")
    assert s.last_tracker is not None and s.last_tracker.ignored_results == 1


async def test_child_result_is_not_the_turn_result() -> None:
    def mutate(steps: list[Step]) -> list[Step]:
        out: list[Step] = []
        for d, o in steps:
            if d == "recv" and isinstance(o, dict) and o.get("subtype") == "task_notification":
                res = next(x for x in recv_objs(steps) if x.get("type") == "result")
                out.append(("recv", {**res, "parent_tool_use_id": "toolu_child", "result": "child's own"}))
            out.append((d, o))
        return out

    out, *_ = await replay("child_agent", mutate=mutate)
    assert isinstance(out, Settlement) and out.assistant_text == "parent done"


async def test_result_before_idle_then_eof_is_transport_closed() -> None:
    def mutate(steps: list[Step]) -> list[Step]:
        return [(d, o) for d, o in steps if not (isinstance(o, dict) and o.get("state") == "idle")]

    out, s, _, _ = await replay("success", mutate=mutate)
    assert isinstance(out, NotSettled) and out.reason is NotSettledReason.TRANSPORT_CLOSED
    assert "before idle" in out.detail and s.locator is None


async def test_stream_cut_mid_turn_is_transport_closed() -> None:
    def mutate(steps: list[Step]) -> list[Step]:
        i = next(i for i, (d, o) in enumerate(steps) if isinstance(o, dict) and o.get("type") == "assistant")
        return steps[: i + 1]

    out, *_ = await replay("success", mutate=mutate)
    assert isinstance(out, NotSettled) and out.reason is NotSettledReason.TRANSPORT_CLOSED
    assert out.assistant_text.startswith("ok 1: ")  # partial text travels with the failure


@pytest.mark.parametrize("alive", [True, False])
async def test_settlement_waits_out_the_transcript_flush_window(alive: bool) -> None:
    header, steps = load_stream("success")
    grace = SETTINGS.model_copy(update={"persist_grace_s": 0.15})
    s, _ = make_session(steps, header["expected"], settings=grace, hold_open=alive)
    await s.handshake()
    t0 = anyio.current_time()
    with anyio.fail_after(5):
        out = await s.run_turn("hi")
    if alive:
        # the loop's clock is millisecond-grained (uvloop): two readings near 85 000 s that are
        # 150 ms apart subtract to 0.14999999999417923, hence the float's tolerance
        assert isinstance(out, Settlement) and anyio.current_time() - t0 >= 0.15 - 1e-6 and s.locator == s.expected
    else:  # the process ended inside the window: the turn may not be on disk
        assert isinstance(out, NotSettled) and out.reason is NotSettledReason.TRANSPORT_CLOSED
        assert "flush window" in out.detail and s.locator is None


async def test_lines_read_during_the_flush_window_are_kept_for_the_next_turn() -> None:
    header, steps = load_stream("live")
    s, _ = make_session(steps, header["expected"], settings=SETTINGS.model_copy(update={"persist_grace_s": 0.1}),
                        hold_open=True)
    with anyio.fail_after(5):
        await s.handshake()
        r1 = await s.run_turn("one")
        r2 = await s.run_turn("two")
    assert isinstance(r1, Settlement) and isinstance(r2, Settlement) and r2.assistant_text.startswith("ok 2: ")


async def test_without_state_events_the_result_settles() -> None:
    header, steps = load_stream("success")
    steps = [(d, o) for d, o in steps if not (isinstance(o, dict) and o.get("subtype") == "session_state_changed")]
    s, _ = make_session(steps, header["expected"], settings=SETTINGS.model_copy(update={"state_events": False}))
    with anyio.fail_after(5):
        await s.handshake()
        assert isinstance(await s.run_turn("hi"), Settlement)


async def test_stale_result_of_an_unread_aborted_turn_is_skipped() -> None:
    _, interrupted = load_stream("interrupt")
    header, restored = load_stream("restored")
    leftovers = [("recv", o) for o in recv_objs(interrupted)
                 if o.get("type") in ("user", "result") or o.get("state") == "idle"]
    i = next(i for i, (d, o) in enumerate(restored) if isinstance(o, dict) and o.get("type") == "user")
    steps = [*restored[: i + 1], *leftovers, *restored[i + 1:]]
    s, _ = make_session(steps, header["expected"], resume=True)
    with anyio.fail_after(5):
        await s.handshake()
        out = await s.run_turn("next")
    assert isinstance(out, Settlement) and not out.is_error and out.assistant_text.startswith("ok 2: ")
    assert s.last_tracker is not None and s.last_tracker.stale_results == 1


async def test_cli_permission_request_is_refused_not_left_hanging() -> None:
    def mutate(steps: list[Step]) -> list[Step]:
        i = next(i for i, (d, o) in enumerate(steps) if isinstance(o, dict) and o.get("subtype") == "init")
        req = {"type": "control_request", "request_id": "cli-1",
               "request": {"subtype": "can_use_tool", "tool_name": "Bash", "input": {}}}
        return [*steps[: i + 1], ("recv", req), *steps[i + 1:]]

    out, _, t, _ = await replay("success", mutate=mutate)
    assert isinstance(out, Settlement)
    refusals = [o for o in t.sent if o.get("type") == "control_response"]
    assert refusals and refusals[0]["response"]["subtype"] == "error" and refusals[0]["response"]["request_id"] == "cli-1"


# ---------------------------------------------------------------- timeout / cancellation


async def test_timeout_sends_interrupt_then_not_settled() -> None:
    header, steps = load_stream("interrupt")
    s, t = make_session(steps, header["expected"])
    with anyio.fail_after(10):
        await s.handshake()
        out = await s.run_turn("STALL forever", timeout_s=0.3)
    assert isinstance(out, NotSettled) and out.reason is NotSettledReason.TIMEOUT
    assert t.sent_subtypes() == ["initialize", "interrupt"]
    assert s.quiesced and s.last_tracker is not None
    assert s.last_tracker.result is not None and s.last_tracker.result["terminal_reason"] == "aborted_streaming"
    assert s.locator is None and s.turns == 0


async def test_cancellation_sends_interrupt_and_reraises() -> None:
    header, steps = load_stream("interrupt")
    s, t = make_session(steps, header["expected"])
    await s.handshake()
    with anyio.move_on_after(0.3) as scope:
        await s.run_turn("STALL forever", timeout_s=60)
        pytest.fail("returned after cancellation")
    assert scope.cancelled_caught
    assert t.sent_subtypes() == ["initialize", "interrupt"]


async def test_send_failure_is_transport_closed() -> None:
    header, steps = load_stream("success")
    s, t = make_session(steps, header["expected"])
    await s.handshake()
    t.closed = True
    out = await s.run_turn("hi")
    assert isinstance(out, NotSettled) and out.reason is NotSettledReason.TRANSPORT_CLOSED


# ---------------------------------------------------------------- handshake


async def test_resume_unknown_is_native_state_missing() -> None:
    header, steps = load_stream("resume_unknown")
    s, _ = make_session(steps, header["expected"], resume=True)
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING
    assert "No conversation found" in exc.value.detail


async def test_new_process_error_result_is_process_failed() -> None:
    header, steps = load_stream("resume_unknown")
    s, _ = make_session(steps, header["expected"], resume=False)
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.PROCESS_FAILED


@pytest.mark.parametrize(("resume", "reason"), [(True, HandshakeReason.PROCESS_FAILED),
                                                (False, HandshakeReason.PROCESS_FAILED)])
async def test_eof_before_initialize_response(resume: bool, reason: HandshakeReason) -> None:
    # A bare EOF says nothing about the native state (a killed process or container): it must
    # never condemn an intact member as LOST; only the precheck or the CLI's own error does.
    s, _ = make_session([("send", {"type": "control_request"})], OTHER, resume=resume)
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is reason


@pytest.mark.parametrize(("payload", "reason"), [
    ({"type": "launch_error", "reason": "missing_file", "path": "/x.jsonl"}, HandshakeReason.NATIVE_STATE_MISSING),
    ({"type": "launch_error", "reason": "fork_point_missing", "path": "/x.jsonl"}, HandshakeReason.NATIVE_STATE_MISSING),
    ({"type": "launch_error", "reason": "exec_failed", "command": "claude"}, HandshakeReason.PROCESS_FAILED),
])
async def test_launch_error_line(payload: dict[str, Any], reason: HandshakeReason) -> None:
    s, t = make_session([("recv", payload)], OTHER, resume=True)
    t.closed = True  # the launcher exited: our initialize cannot even be written
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is reason


async def test_handshake_root_event_with_another_id_is_locator_mismatch() -> None:
    steps: list[Step] = [("send", {}), ("recv", {"type": "system", "subtype": "status", "session_id": OTHER})]
    s, _ = make_session(steps, "11111111-2222-4333-8444-555555555555", resume=True)
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.LOCATOR_MISMATCH and exc.value.observed == Locator(id=OTHER)


async def test_initialize_refused() -> None:
    steps: list[Step] = [("send", {"type": "control_request", "request_id": "r"}),
                         ("recv", {"type": "control_response",
                                   "response": {"subtype": "error", "request_id": "r", "error": "nope"}})]
    s, _ = make_session(steps, OTHER)
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.PROCESS_FAILED and "nope" in exc.value.detail


async def test_handshake_timeout() -> None:
    s, _ = make_session([("send", {}), ("send", {})], OTHER,
                        settings=SETTINGS.model_copy(update={"handshake_timeout_s": 0.2}))
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.PROCESS_FAILED and "no initialize response" in exc.value.detail
