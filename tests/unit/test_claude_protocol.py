"""Pure parts of the Claude protocol: project-dir sanitising, stdin lines, failure reasons,
normalization, and the turn tracker's settlement rule."""

from __future__ import annotations

import pytest

from drivers.claude.wire import (
    TurnTracker,
    failure_reason,
    is_root,
    is_turn_result,
    is_uuid,
    normalize,
    root_session_id,
    sanitize_project_dir,
    transcript_path,
    user_line,
)
from drivers.models import FailureReason, Notice, RetryNotice, TextDelta, ToolFinished, ToolStarted

SID = "11111111-2222-4333-8444-555555555555"
OTHER = "99999999-aaaa-4bbb-8ccc-dddddddddddd"

# Directory names the real 2.1.220 created (integration runs and a host probe).
_LONG_A = ("/var/tmp/ca-claude-yssjil94/test_long_workspace_path_uses_the_hashed_project_dir/w.dot_und er-"
           + "x" * 60 + "/" + "y" * 80 + "/" + "z" * 70)
_LONG_B = _LONG_A.replace("yssjil94", "kelio_2p")


@pytest.mark.parametrize(("cwd", "name"), [
    ("/tmp/cl/ws1", "-tmp-cl-ws1"),
    ("/scratch/w.dot_und er", "-scratch-w-dot-und-er"),
    ("/tmp/cl/ws-é-中-🚀 x", "-tmp-cl-ws--------x"),  # the emoji is two UTF-16 units: two dashes
])
def test_sanitize_short(cwd: str, name: str) -> None:
    assert sanitize_project_dir(cwd) == name


@pytest.mark.parametrize(("cwd", "suffix"), [(_LONG_A, "maphb0"), (_LONG_B, "xuqz1i")])
def test_sanitize_long_is_cut_and_hashed_like_the_cli(cwd: str, suffix: str) -> None:
    name = sanitize_project_dir(cwd)
    assert name == sanitize_project_dir(cwd)[:200] + "-" + suffix
    assert name[:200] == "".join(c if c.isascii() and c.isalnum() else "-" for c in cwd)[:200]


def test_transcript_path() -> None:
    assert transcript_path("/h/.claude/", "/w s", SID) == f"/h/.claude/projects/-w-s/{SID}.jsonl"


def test_is_uuid() -> None:
    assert is_uuid(SID) and not is_uuid("../../etc/passwd") and not is_uuid(SID.upper() + "x")


def test_user_line_plain_and_slash() -> None:
    text = "  multi\n\nparagraph 中文 🚀 {\"a\": 1}  "
    assert user_line(text)["message"]["content"] == text
    assert user_line("/clear")["message"]["content"] == [{"type": "text", "text": "/clear"},
                                                         {"type": "text", "text": ""}]
    assert user_line(" /help")["message"]["content"] == " /help"  # the CLI does not trim


def _result(**kw) -> dict:
    base = {"type": "result", "subtype": "success", "is_error": True, "session_id": SID}
    return {**base, **kw}


@pytest.mark.parametrize(("result", "reason"), [
    (_result(terminal_reason="prompt_too_long", api_error_status=400), FailureReason.CONTEXT_TOO_LONG),
    (_result(terminal_reason="api_error", api_error_status=400,
             result="API Error: 400 prompt is too long: 200001 tokens > 131072 maximum"), FailureReason.CONTEXT_TOO_LONG),
    (_result(terminal_reason="api_error", api_error_status=400, result="API Error: 400 bad"), FailureReason.API_ERROR),
    (_result(terminal_reason="api_error", api_error_status=429, result="API Error: 429"), FailureReason.RATE_LIMITED),
    (_result(terminal_reason="api_error", api_error_status=529, result="API Error: 529 Overloaded"),
     FailureReason.OVERLOADED),
    (_result(terminal_reason="api_error", api_error_status=500, result="API Error: 500 Overloaded"),
     FailureReason.OVERLOADED),
    (_result(terminal_reason="api_error", api_error_status=401, result="Invalid API key"), FailureReason.AUTH),
    (_result(terminal_reason="api_error", api_error_status=403), FailureReason.AUTH),
    (_result(terminal_reason="api_error", api_error_status=502, result="API Error: 502"), FailureReason.API_ERROR),
    (_result(subtype="error_during_execution", terminal_reason="aborted_streaming",
             errors=["[ede_diagnostic] x"]), FailureReason.ABORTED),
    (_result(subtype="error_during_execution", terminal_reason="aborted_tools"), FailureReason.ABORTED),
    (_result(subtype="error_max_turns", terminal_reason="max_turns"), FailureReason.TRUNCATED),
    (_result(subtype="error_max_turns"), FailureReason.TRUNCATED),
    (_result(subtype="error_during_execution", errors=["something odd"]), FailureReason.API_ERROR),
])
def test_failure_reason(result: dict, reason: FailureReason) -> None:
    assert failure_reason(result) is reason


def test_root_and_result_predicates() -> None:
    assert is_root({"parent_tool_use_id": None}) and is_root({}) and not is_root({"parent_tool_use_id": "t"})
    assert root_session_id({"session_id": SID}) == SID
    assert root_session_id({"session_id": SID, "parent_tool_use_id": "t"}) is None
    assert root_session_id({"session_id": 5}) is None and root_session_id({"session_id": ""}) is None
    assert is_turn_result(_result()) and not is_turn_result(_result(origin={"kind": "task-notification"}))
    assert not is_turn_result(_result(parent_tool_use_id="t"))


def test_normalize_shapes() -> None:
    assistant = {"type": "assistant", "parent_tool_use_id": None, "message": {"content": [
        {"type": "text", "text": "hi"}, {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}}]}}
    kinds = [type(e) for e in normalize(assistant)]
    assert kinds == [TextDelta, ToolStarted]
    child = {**assistant, "parent_tool_use_id": "tp"}
    assert [type(e) for e in normalize(child)] == [Notice]  # child text is never the turn's text
    user = {"type": "user", "message": {"content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                                     "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]}}
    (fin,) = normalize(user)
    assert isinstance(fin, ToolFinished) and fin.is_error and fin.output == "a\nb" and fin.raw == user
    (retry,) = normalize({"type": "system", "subtype": "api_retry", "attempt": 2, "error_status": None, "error": "unknown"})
    assert isinstance(retry, RetryNotice) and retry.attempt == 2 and retry.status is None
    assert normalize({"type": "assistant", "message": "garbage"}) == []
    assert normalize({"type": "system", "subtype": "api_retry", "attempt": True}) [0].attempt is None


def _ev(kind: str, **kw) -> dict:
    if kind in ("init", "session_state_changed", "api_retry", "task_started", "task_notification",
                "background_tasks_changed"):
        return {"type": "system", "subtype": kind, "session_id": SID, **kw}
    return {"type": kind, "session_id": SID, **kw}


def test_tracker_settles_on_result_then_idle() -> None:
    t = TurnTracker(SID)
    for obj in (_ev("session_state_changed", state="running"), _ev("init", claude_code_version="2.1.220"),
                _ev("assistant", message={"content": [{"type": "text", "text": "x"}]}), _result(is_error=False, result="x")):
        t.feed(obj)
        assert not t.settled
    t.feed(_ev("session_state_changed", state="idle"))
    assert t.settled and t.cli_version == "2.1.220"
    s = t.settlement()
    assert s.assistant_text == "x" and not s.is_error and s.observed_locator.id == SID


def test_tracker_waits_for_background_tasks_after_an_early_idle() -> None:
    t = TurnTracker(SID)
    for obj in (_ev("init"), _ev("task_started", task_id="a"), _ev("background_tasks_changed", tasks=[{"task_id": "a"}]),
                _result(is_error=False), _ev("session_state_changed", state="idle")):
        t.feed(obj)
    assert not t.settled and t.early_idles == 1
    t.feed(_ev("task_notification", task_id="a"))
    t.feed(_ev("background_tasks_changed", tasks=[]))
    assert not t.settled  # needs an idle with nothing outstanding
    t.feed(_ev("session_state_changed", state="running"))
    t.feed(_result(is_error=False, origin={"kind": "task-notification"}))
    t.feed(_ev("session_state_changed", state="idle"))
    assert t.settled and t.ignored_results == 1


def test_tracker_identity() -> None:
    t = TurnTracker(SID)
    t.feed({**_ev("assistant"), "parent_tool_use_id": "tp", "session_id": OTHER})
    assert not t.init_mismatch
    t.feed(_ev("init"))
    t.feed({**_result(is_error=False), "session_id": OTHER})
    assert t.init_mismatch and t.observed_locator().id == OTHER


def test_tracker_without_expected_takes_the_first_root_id() -> None:
    t = TurnTracker(None)
    t.feed(_ev("init"))
    assert t.observed_locator().id == SID and not t.init_mismatch
    t.feed({**_ev("init"), "session_id": OTHER})
    assert t.init_mismatch and t.observed_locator().id == OTHER
