"""The audit walks only the messages a member's request does not share with its last
conversational one (proxy/audit_memo.py): the same digest as a fresh audit, the shared
messages' results taken as they were, and memory bounded and given back."""

from __future__ import annotations

import json
from typing import Any

from proxy.audit import audit_request
from proxy.audit_memo import AuditMemo
from proxy.routes import ROUTES

ANTHROPIC = next(r for r in ROUTES if r.name == "anthropic.messages")
RESPONSES = next(r for r in ROUTES if r.name == "openai.responses")
M1, M2 = ("chat-a", "m1"), ("chat-a", "m2")


def body(*turns: tuple[str, str], system: str = "you are a coding agent") -> bytes:
    messages: list[dict[str, Any]] = [{"role": r, "content": [{"type": "text", "text": t}]} for r, t in turns]
    return json.dumps({"model": "m", "max_tokens": 64, "system": system, "messages": messages}).encode()


def history(n: int) -> list[tuple[str, str]]:
    return [("user" if i % 2 == 0 else "assistant", f"message {i} <system-reminder>x</system-reminder>")
            for i in range(n)]


def test_a_follow_up_walks_only_its_new_messages_and_digests_as_a_fresh_audit() -> None:
    memo = AuditMemo()
    first = audit_request(body(*history(5)), None, ANTHROPIC, capture=True, memo=memo, member=M1)
    assert (first.remembered, first.walked, len(memo)) == (0, 5, 1)
    raw = body(*history(7))
    again = audit_request(raw, None, ANTHROPIC, capture=True, memo=memo, member=M1)
    fresh = audit_request(raw, None, ANTHROPIC, capture=True)
    assert (again.kind, again.digest, again.capture) == (fresh.kind, fresh.digest, fresh.capture)
    assert (again.remembered, again.walked) == (5, 2)
    assert again.digest is not None and first.digest is not None
    # the shared messages' entries are the ones the last walk made (the sink and the judge then
    # find the shared prefix by identity), the new ones are new
    assert all(a is b for a, b in zip(again.digest[:5], first.digest, strict=True))
    assert [e.role for e in again.digest] == ["user", "assistant"] * 3 + ["user"]


def test_an_edited_earlier_message_is_walked_from_there_on() -> None:
    memo = AuditMemo()
    audit_request(body(*history(6)), None, ANTHROPIC, capture=False, memo=memo, member=M1)
    edited = [*history(7)]
    edited[2] = ("user", "a rewritten message")
    raw = body(*edited)
    got = audit_request(raw, None, ANTHROPIC, capture=False, memo=memo, member=M1)
    assert (got.remembered, got.walked) == (2, 5)
    assert got.digest == audit_request(raw, None, ANTHROPIC, capture=False).digest
    # the same message under another block layout is another message: walked
    split = json.loads(raw)
    split["messages"][0]["content"] = [{"type": "text", "text": "message 0 "}, {"type": "text", "text": "<system"
                                                                                   "-reminder>x</system-reminder>"}]
    got = audit_request(json.dumps(split).encode(), None, ANTHROPIC, capture=False, memo=memo, member=M1)
    assert got.remembered == 0 and got.digest == audit_request(json.dumps(split).encode(), None, ANTHROPIC,
                                                               capture=False).digest


def test_only_the_same_members_conversation_is_remembered() -> None:
    memo = AuditMemo()
    audit_request(body(*history(4)), None, ANTHROPIC, capture=False, memo=memo, member=M1)
    other = audit_request(body(*history(6)), None, ANTHROPIC, capture=False, memo=memo, member=M2)
    assert other.remembered == 0  # another member's
    # a side request (a title) reads the memo but does not replace the conversation in it
    title = audit_request(body(*history(4), system="You are a title generator"), None, ANTHROPIC, capture=False,
                          memo=memo, member=M1)
    assert (title.kind, title.remembered) == ("title", 4)
    assert audit_request(body(*history(6)), None, ANTHROPIC, capture=False, memo=memo, member=M1).remembered == 4
    # another shape never shares: its messages are other objects with other rules
    as_responses = json.dumps({"model": "m", "input": [{"role": r, "content": t} for r, t in history(6)]}).encode()
    got = audit_request(as_responses, None, RESPONSES, capture=False, memo=memo, member=M1)
    assert (got.remembered, got.walked) == (0, 6)
    # no member (a request no member's socket made): nothing remembered, nothing kept
    before = len(memo)
    assert audit_request(body(*history(8)), None, ANTHROPIC, capture=False, memo=memo, member=None).remembered == 0
    assert len(memo) == before


def test_the_memo_is_bounded_by_request_bytes_and_forgets_a_closed_chat() -> None:
    one = len(body(*history(10)))
    memo = AuditMemo(max_bytes=2 * one + 10)
    for member in (("chat-a", "m1"), ("chat-a", "m2"), ("chat-b", "m1")):
        audit_request(body(*history(10)), None, ANTHROPIC, capture=False, memo=memo, member=member)
    assert len(memo) == 2 and memo.bytes == 2 * one  # the least recently used one went
    items = json.loads(body(*history(12)))["messages"]
    assert memo.shared(("chat-a", "m1"), "anthropic", items) == []
    assert len(memo.shared(("chat-a", "m2"), "anthropic", items)) == 10
    memo.forget_chat("chat-a")
    assert (len(memo), memo.bytes) == (1, one)
    memo.forget_chat("chat-b")
    assert (len(memo), memo.bytes) == (0, 0)
    # a request larger than the whole bound is never kept
    small = AuditMemo(max_bytes=100)
    audit_request(body(*history(10)), None, ANTHROPIC, capture=False, memo=small, member=M1)
    assert (len(small), small.bytes) == (0, 0)
