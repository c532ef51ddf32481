"""pi_protocol helpers: failure reasons, texts, locators (pure functions)."""

from __future__ import annotations

import pytest

from drivers.models import FailureReason, Locator
from drivers.pi.wire import PiTurn, failure_reason, http_status, message_text, state_locator

ANTH_400 = '400 {"type":"error","error":{"type":"invalid_request_error","message":"%s"}}'


@pytest.mark.parametrize(("stop", "error", "reason"), [
    ("error", ANTH_400 % "prompt is too long: 200001 tokens > 131072 maximum", FailureReason.CONTEXT_TOO_LONG),
    ("error", "400 This model's maximum context length is 131072 tokens.", FailureReason.CONTEXT_TOO_LONG),
    ("error", '429 {"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}',
     FailureReason.RATE_LIMITED),
    ("error", '529 {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}',
     FailureReason.OVERLOADED),
    ("error", '401 {"type":"error","error":{"type":"authentication_error","message":"bad key"}}', FailureReason.AUTH),
    ("error", 'Failed to resolve API key for provider "gateway" from shell command: printenv X', FailureReason.AUTH),
    ("error", ANTH_400 % "fixture: request rejected (terminal)", FailureReason.API_ERROR),
    ("error", "Anthropic stream ended before message_stop", FailureReason.API_ERROR),
    ("aborted", "This operation was aborted", FailureReason.ABORTED),
    ("length", None, FailureReason.TRUNCATED),
])
def test_failure_reason(stop, error, reason) -> None:
    assert failure_reason(stop, error) is reason


def test_abort_we_sent_wins_over_the_error_text() -> None:
    assert failure_reason("error", "500 boom", aborted=True) is FailureReason.ABORTED


def test_small_helpers() -> None:
    assert http_status("503 {...}") == 503 and http_status("Connection error.") is None and http_status(None) is None
    assert message_text({"content": [{"type": "text", "text": "a"}, {"type": "toolCall"}, {"type": "text", "text": "b"}]}) == "ab"
    assert message_text({"content": "plain"}) == "plain" and message_text({"content": 3}) == ""
    assert state_locator({"sessionId": "i", "sessionFile": "/p"}) == Locator(id="i", path="/p")
    assert state_locator({"sessionId": "i"}) is None and state_locator({"sessionId": 1, "sessionFile": "/p"}) is None


def test_length_stop_is_a_truncated_settlement() -> None:
    turn = PiTurn(prompt_id="p")
    turn.feed({"type": "response", "id": "p", "command": "prompt", "success": True})
    turn.feed({"type": "agent_start"})
    turn.feed({"type": "message_end", "message": {"role": "assistant", "stopReason": "length",
                                                  "content": [{"type": "text", "text": "cut sho"}]}})
    step = turn.feed({"type": "agent_end", "messages": [{"role": "assistant", "stopReason": "length"}]})
    assert step.send_barrier
    turn.barrier_sent("b")
    out = turn.feed({"type": "response", "id": "b", "command": "get_state", "success": True,
                     "data": {"isStreaming": False, "isCompacting": False, "sessionId": "i", "sessionFile": "/p"}})
    s = out.settlement
    assert s is not None and s.is_error and s.reason is FailureReason.TRUNCATED and s.assistant_text == "cut sho"


def test_busy_barrier_answer_does_not_settle_and_compaction_end_rearms() -> None:
    turn = PiTurn(prompt_id="p")
    for obj in ({"type": "response", "id": "p", "command": "prompt", "success": True}, {"type": "agent_start"},
                {"type": "message_end", "message": {"role": "assistant", "stopReason": "stop", "content": []}}):
        turn.feed(obj)
    assert turn.feed({"type": "agent_end", "messages": []}).send_barrier
    turn.barrier_sent("b1")
    assert not turn.feed({"type": "compaction_start", "reason": "threshold"}).send_barrier  # b1 still out
    busy = turn.feed({"type": "response", "id": "b1", "success": True, "data": {"isStreaming": False,
                                                                               "isCompacting": True}})
    assert busy.settlement is None
    assert turn.feed({"type": "compaction_end", "reason": "threshold", "willRetry": False}).send_barrier
    turn.barrier_sent("b2")
    done = turn.feed({"type": "response", "id": "b2", "success": True,
                      "data": {"isStreaming": False, "isCompacting": False}})
    assert done.settlement is not None and not done.settlement.is_error
