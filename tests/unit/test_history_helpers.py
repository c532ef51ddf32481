"""The request-history matrix's failed-turn check reads every request of the turn."""

from __future__ import annotations

import pytest

from deploy.loopback import Message, RecordedRequest
from tests.regression.history_helpers import TurnResult, assert_failed_requests


def request(seq: int, users: list[str]) -> RecordedRequest:
    body = {"model": "m", "stream": True, "max_tokens": 10,
            "messages": [{"role": "user", "content": u} for u in users]}
    return RecordedRequest(seq=seq, time=0.0, method="POST", path="/v1/messages", api="anthropic",
                           kind="conversation", body=body, status=529)


def turn(*requests: RecordedRequest) -> TurnResult:
    return TurnResult(message="again", receipt={}, events=[], requests=list(requests), seconds=0.0)


EXPECTED = [Message.user("first"), Message.user("again")]


def test_every_request_of_a_failed_turn_carries_the_history() -> None:
    assert_failed_requests(turn(request(1, ["first", "again"]), request(2, ["first", "again"])), EXPECTED, "claude")


def test_a_retry_that_lost_a_message_fails_the_check() -> None:
    t = turn(request(1, ["first", "again"]), request(2, ["first", "again"]), request(3, ["again"]))
    with pytest.raises(AssertionError, match=r"conversational request 3/3 \(seq 3\)"):
        assert_failed_requests(t, EXPECTED, "claude")


def test_a_request_checked_apart_must_exist_and_is_skipped() -> None:
    t = turn(request(1, ["first", "again"]), request(2, ["a summary", "again"]))
    assert_failed_requests(t, EXPECTED, "pi", checked_apart=frozenset({1}))
    with pytest.raises(AssertionError, match=r"checked_apart \[2\] of 2 requests"):
        assert_failed_requests(t, EXPECTED, "pi", checked_apart=frozenset({2}))
