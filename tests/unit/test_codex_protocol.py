"""Codex wire parsing over recorded real 0.171.0 streams (tests/data/codex/) and fuzzed input."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drivers.codex.wire import (
    Kind,
    TurnTracker,
    answer_server_request,
    failure_reason,
    kind_of,
)
from drivers.models import ErrorNotice, FailureReason, Locator, Notice, RetryNotice, TextDelta, ToolFinished, ToolStarted
from tests.support.replay import load_stream

DATA = Path(__file__).resolve().parents[1] / "data" / "codex"


def recv(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for d, line in load_stream(DATA / f"{name}.jsonl") if d == "recv"]


def first_turn(name: str) -> tuple[str, str]:
    """(thread id, turn id) of the first turn/start response in a recording."""
    msgs = recv(name)
    thread = next(m["result"]["thread"]["id"] for m in msgs if m.get("id") == 1 and "result" in m)
    turn = next(m["result"]["turn"]["id"] for m in msgs if "result" in m and "turn" in (m["result"] or {}))
    return thread, turn


def track(name: str, msgs: list[dict[str, Any]] | None = None) -> tuple[TurnTracker, list[Any]]:
    thread, turn = first_turn(name)
    tracker = TurnTracker(thread, turn)
    events: list[Any] = []
    for msg in msgs if msgs is not None else recv(name):
        events += tracker.feed(msg)
    return tracker, events


# ---------------------------------------------------------------- message kinds


@pytest.mark.parametrize(("msg", "kind"), [
    ({"id": 0, "result": {}}, Kind.RESPONSE),
    ({"id": 0, "error": {"code": -32600, "message": "x"}}, Kind.RESPONSE),
    # a server request reuses id 0 (its own counter): `method` decides
    ({"method": "item/commandExecution/requestApproval", "id": 0, "params": {}}, Kind.REQUEST),
    ({"method": "turn/completed", "params": {}}, Kind.NOTIFICATION),
    ({"id": 3}, Kind.OTHER),
    ({"method": 5, "id": 1}, Kind.OTHER),
    ({}, Kind.OTHER),
])
def test_kind_of(msg: dict[str, Any], kind: Kind) -> None:
    assert kind_of(msg) is kind


@pytest.mark.parametrize(("method", "result"), [
    ("item/commandExecution/requestApproval", {"decision": "decline"}),
    ("item/fileChange/requestApproval", {"decision": "decline"}),
    ("execCommandApproval", {"decision": "denied"}),
    ("applyPatchApproval", {"decision": "denied"}),
    ("mcpServer/elicitation/request", {"action": "decline"}),
    ("item/tool/requestUserInput", {"answers": {}}),
    ("item/tool/call", {"contentItems": [], "success": False}),
    ("item/permissions/requestApproval", {"permissions": {}}),
])
def test_server_requests_are_refused_in_their_own_shape(method: str, result: dict[str, Any]) -> None:
    assert answer_server_request({"method": method, "id": 0, "params": {}}) == {"id": 0, "result": result}


def test_unknown_server_request_gets_a_jsonrpc_error() -> None:
    reply = answer_server_request({"method": "account/chatgptAuthTokens/refresh", "id": "x7"})
    assert reply["id"] == "x7" and reply["error"]["code"] == -32601


# ---------------------------------------------------------------- failure reasons


@pytest.mark.parametrize(("error", "reason"), [
    ({"message": '{"error": {"message": "fixture: request rejected (terminal)"}}', "codexErrorInfo": "other"},
     FailureReason.API_ERROR),
    ({"message": "This model's maximum context length is 131072 tokens.", "codexErrorInfo": "other"},
     FailureReason.CONTEXT_TOO_LONG),
    ({"message": "Codex ran out of room in the model's context window.", "codexErrorInfo": "contextWindowExceeded"},
     FailureReason.CONTEXT_TOO_LONG),
    ({"message": "exceeded retry limit, last status: 429 Too Many Requests",
      "codexErrorInfo": {"responseTooManyFailedAttempts": {"httpStatusCode": 429}}}, FailureReason.RATE_LIMITED),
    ({"message": "We’re currently experiencing high demand, which may cause temporary errors.",
      "codexErrorInfo": "internalServerError"}, FailureReason.API_ERROR),
    ({"message": "x", "codexErrorInfo": {"responseTooManyFailedAttempts": {"httpStatusCode": 503}}},
     FailureReason.OVERLOADED),
    ({"message": "x", "codexErrorInfo": {"responseTooManyFailedAttempts": {"httpStatusCode": 502}}},
     FailureReason.API_ERROR),
    ({"message": "x", "codexErrorInfo": {"httpConnectionFailed": {"httpStatusCode": 401}}}, FailureReason.AUTH),
    ({"message": "x", "codexErrorInfo": "serverOverloaded"}, FailureReason.OVERLOADED),
    ({"message": "x", "codexErrorInfo": "usageLimitExceeded"}, FailureReason.RATE_LIMITED),
    ({"message": "x", "codexErrorInfo": "unauthorized"}, FailureReason.AUTH),
    ({"message": "stream idle timeout", "codexErrorInfo": {"responseStreamDisconnected": {"httpStatusCode": None}}},
     FailureReason.API_ERROR),
    ({}, FailureReason.API_ERROR),
])
def test_failure_reason(error: dict[str, Any], reason: FailureReason) -> None:
    assert failure_reason(error) is reason


# ---------------------------------------------------------------- recorded streams


def test_success_stream() -> None:
    tracker, events = track("success")
    s = tracker.settlement
    assert s is not None and not s.is_error and s.evidence == "codex:turn/completed"
    assert s.assistant_text == "".join(e.text for e in events if isinstance(e, TextDelta)) != ""
    assert s.observed_locator == Locator(id=tracker.thread_id)
    assert s.raw and s.raw[0]["method"] == "turn/completed"
    assert [e.name for e in events if isinstance(e, Notice)] == ["warning"]  # unknown-slug warning, not an error
    # the second turn of the recording belongs to another turn id: the tracker is settled and deaf
    assert tracker.feed(recv("success")[-1]) == []


@pytest.mark.parametrize(("name", "reason", "needle"), [
    ("failed_400", FailureReason.API_ERROR, "fixture: request rejected (terminal)"),
    ("context_window", FailureReason.CONTEXT_TOO_LONG, "contextWindowExceeded"),
    ("rate_limited", FailureReason.RATE_LIMITED, "429"),
])
def test_settled_failure_streams(name: str, reason: FailureReason, needle: str) -> None:
    tracker, events = track(name)
    s = tracker.settlement
    assert s is not None and s.is_error and s.reason is reason and needle in (s.detail or "")
    assert s.observed_locator == Locator(id=tracker.thread_id)
    errors = [e for e in events if isinstance(e, ErrorNotice)]
    assert len(errors) == 1 and not errors[0].will_retry


def test_retry_notice_is_progress_not_settlement() -> None:
    msgs = recv("retry_then_success")
    retry_at = next(i for i, m in enumerate(msgs) if m.get("method") == "error")
    tracker, events = track("retry_then_success", msgs[: retry_at + 1])
    assert tracker.settlement is None
    retries = [e for e in events if isinstance(e, RetryNotice)]
    assert len(retries) == 1 and retries[0].attempt == 1 and "stream disconnected" in (retries[0].detail or "")
    for m in msgs[retry_at + 1:]:
        tracker.feed(m)
    s = tracker.settlement
    assert s is not None and not s.is_error and s.assistant_text.startswith("ok 1: ")


def test_tool_stream() -> None:
    tracker, events = track("tool_call")
    started = [e for e in events if isinstance(e, ToolStarted)]
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert [(e.tool, e.input) for e in started] == [("commandExecution", "/bin/bash -lc 'echo tool-output'")]
    assert finished[0].call_id == started[0].call_id and not finished[0].is_error
    assert "tool-output" in (finished[0].output or "")
    assert tracker.settlement is not None and tracker.settlement.assistant_text == "tool finished"


def test_interrupted_stream_settles_as_aborted() -> None:
    tracker, _ = track("interrupted")
    s = tracker.settlement
    assert s is not None and s.is_error and s.reason is FailureReason.ABORTED


def test_declined_command_is_a_failed_tool() -> None:
    tracker, events = track("server_request")
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert len(finished) == 1 and finished[0].is_error  # status "declined"
    assert tracker.settlement is not None and tracker.settlement.assistant_text == "after the approval"


def test_other_threads_and_turns_are_ignored() -> None:
    msgs = recv("foreign_thread")
    ours = msgs[[i for i, m in enumerate(msgs) if m.get("id") == 5][0]]["result"]["turn"]["id"]
    thread = first_turn("foreign_thread")[0]
    tracker = TurnTracker(thread, ours)
    events = [e for m in msgs for e in tracker.feed(m)]
    s = tracker.settlement
    assert s is not None and not s.is_error and s.assistant_text == "ok 2: 0fa4d21144"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "ok 2: 0fa4d21144"
    # the first turn (same thread, earlier turn id) and the fork's turn left no trace
    assert all(e.raw.get("params", {}).get("threadId", thread) == thread for e in events)


def test_turn_completed_naming_another_thread_surfaces_as_observed_locator() -> None:
    msgs = recv("success")
    thread, turn = first_turn("success")
    crafted = []
    for m in msgs:
        if m.get("method") == "turn/completed" and m["params"]["turn"]["id"] == turn:
            m = json.loads(json.dumps(m))
            m["params"]["threadId"] = "01a2ffff-0000-7000-8000-000000000000"
        crafted.append(m)
    tracker, _ = track("success", crafted)
    s = tracker.settlement
    assert s is not None and not s.is_error
    assert s.observed_locator == Locator(id="01a2ffff-0000-7000-8000-000000000000") != Locator(id=thread)


def test_notifications_for_another_thread_with_our_turn_id_are_ignored() -> None:
    thread, turn = first_turn("success")
    tracker = TurnTracker(thread, turn)
    assert tracker.feed({"method": "item/agentMessage/delta",
                         "params": {"threadId": "other", "turnId": turn, "itemId": "m", "delta": "x"}}) == []
    assert tracker.feed({"method": "warning", "params": {"threadId": "other", "message": "w"}}) == []
    assert tracker.feed({"method": "error", "params": {"threadId": thread, "turnId": "other",
                                                       "error": {"message": "m"}, "willRetry": True}}) == []


# ---------------------------------------------------------------- fuzz


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
METHODS = ["turn/completed", "item/agentMessage/delta", "item/started", "item/completed", "error", "warning",
           "turn/started", "thread/status/changed"]


@st.composite
def shaped_messages(draw: Any) -> dict[str, Any]:
    """Messages with real method names and fuzzed params, some aimed at the tracked turn."""
    params = draw(st.dictionaries(st.sampled_from(["threadId", "turnId", "turn", "item", "delta", "error",
                                                   "willRetry", "itemId", "message"]), json_values, max_size=6))
    if draw(st.booleans()):
        params["threadId"], params["turnId"] = "T", "U"
    if draw(st.booleans()) and isinstance(params.get("turn"), dict):
        params["turn"]["id"] = "U"
    msg: dict[str, Any] = {"method": draw(st.sampled_from(METHODS)), "params": params}
    if draw(st.booleans()):
        msg["id"] = draw(json_values)
    return msg


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(shaped_messages(), st.dictionaries(st.text(max_size=8), json_values, max_size=5)),
                max_size=30))
def test_tracker_never_raises_on_fuzzed_messages(msgs: list[dict[str, Any]]) -> None:
    tracker = TurnTracker("T", "U")
    for m in msgs:
        tracker.feed(m)
        kind_of(m)
        answer_server_request(m)
    if tracker.settlement is not None:
        assert tracker.settlement.evidence == "codex:turn/completed"


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["message", "codexErrorInfo", "additionalDetails"]), json_values))
def test_failure_reason_never_raises(error: dict[str, Any]) -> None:
    assert isinstance(failure_reason(error), FailureReason)
