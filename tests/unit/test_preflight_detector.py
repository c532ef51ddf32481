"""Missing-history detector and the synthetic cases (no network)."""

from __future__ import annotations

import pytest

from deploy.preflight.cases import CASE_NAMES, build_case, build_cases
from deploy.preflight.detector import find_history_claims


@pytest.mark.parametrize(("reply", "kind", "phrase"), [
    ("I don't have any previous messages from you.", "no_history", "I don't have any previous messages"),
    ("I don\u2019t have access to previous conversations.", "no_history",
     "I don't have access to previous conversations"),
    ("Hi! This is the start of our conversation.", "no_history", "This is the start of our conversation"),
    ("I can't see any previous messages in this chat.", "no_history", "I can't see any previous messages"),
    ("There is no previous conversation to refer to.", "no_history", "There is no previous conversation"),
    ("You haven't asked me anything yet.", "nothing_asked", "You haven't asked me anything"),
    ("我没有之前的对话记录。", "no_history", "我没有之前的对话记录"),
    ("这是我们对话的开始。", "no_history", "这是我们对话的开始"),
    ("我无法查看之前的对话。", "no_history", "我无法查看之前的对话"),
    ("我们的对话才刚刚开始。", "no_history", "我们的对话才刚刚开始"),
    ("你还没有让我做任何事。", "nothing_asked", "你还没有让我做任何事"),
    ("还没有让我做任何事情呢", "nothing_asked", "还没有让我做任何事情"),
])
def test_recognised_claims_name_the_phrase(reply: str, kind: str, phrase: str) -> None:
    claims = find_history_claims(reply)
    assert [(c.kind, c.phrase) for c in claims] == [(kind, phrase)]


@pytest.mark.parametrize("reply", [
    "At the start of our conversation you said hi.",
    "You asked me to rename parse_cfg to load_config in src/settings.py.",
    "你刚才让我把 parse_cfg 重命名为 load_config。",
    "The staging database host is now db-green.internal (previously db-blue.internal).",
    "I can update MEMORY.md so the previous value is not used again.",
    "你问了两次 PostgreSQL 的默认端口（5432）。",
])
def test_ordinary_answers_about_history_are_not_flagged(reply: str) -> None:
    # Conservative: talking *about* earlier turns is not a claim that there were none.
    assert find_history_claims(reply) == []


def test_several_claims_in_one_reply_are_reported_in_order_once_each() -> None:
    claims = find_history_claims("这是我们对话的开始，我没有之前的对话记录，你还没有让我做任何事。")
    assert [c.phrase for c in claims] == ["这是我们对话的开始", "我没有之前的对话记录", "你还没有让我做任何事"]


def test_quoted_claim_is_still_matched_documented_false_positive() -> None:
    # Documented limit: the detector is literal, so correcting a bad claim by quoting it
    # is matched too, and the phrase is named so the operator can see why.
    claims = find_history_claims('I won\'t say "I don\'t have any previous messages": you said hi.')
    assert [c.phrase for c in claims] == ["I don't have any previous messages"]


def test_fifteen_cases_by_default_alternating_language() -> None:
    cases = build_cases(3)
    assert len(cases) == 15
    assert [c.name for c in cases[:5]] == list(CASE_NAMES)
    assert [c.lang for c in cases[::5]] == ["zh", "en", "zh"]
    assert {c.lang for c in build_cases(2, "en")} == {"en"}


def test_greeting_case_shape() -> None:
    case = build_case("greeting", 1, "zh")
    assert [(m.role, m.content) for m in case.messages][0] == ("user", "hi")
    assert case.messages[1].role == "assistant"
    assert case.messages[-1].content == "我刚才让你做什么了"
    assert "memory" in case.system
    assert build_case("greeting", 2, "en").messages[-1].content == "What did I just ask you to do?"


def test_no_history_case_is_a_fresh_conversation() -> None:
    case = build_case("no_history", 1, "en")
    assert len(case.messages) == 1 and case.facts == []


@pytest.mark.parametrize(("name", "answer", "ok"), [
    ("greeting", "You just said \"hi\"; nothing else yet.", True),
    ("greeting", "你刚才只是跟我打了个招呼。", True),
    ("greeting", "Hi! How can I help?", False),  # greeting back is not recall
    ("task", "Rename `parse\\_cfg` to `load\\_config` in src/settings.py.", True),
    ("fact_update", "db-blue.internal", False),
    ("fact_update", "db-green.internal", True),
    ("repeated_question", "PostgreSQL 的默认端口是哪个", True),
])
def test_required_facts(name: str, answer: str, ok: bool) -> None:
    case = build_case(name, 1, "en")
    assert all(f.found_in(answer) for f in case.facts) is ok
