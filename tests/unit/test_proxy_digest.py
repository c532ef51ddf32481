"""The proxy's conversation digest (proxy/digest.py, proxy/classify.py) — hand-built requests of
the three API shapes, the real CLIs' recorded requests, and agreement with the regression
audit (deploy/loopback/audit.py), the independent witness."""

from __future__ import annotations

import hashlib
import json
import string
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deploy.loopback import audit as witness
from deploy.loopback import load_jsonl
from proxy.classify import classify
from proxy.digest import DigestError, decode_body, strip_annotations, text_messages
from proxy.records import DigestEntry, WireRecord, digest_of

DATA = Path(__file__).resolve().parents[1] / "data" / "loopback"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def pairs(body: Any, api: str) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in text_messages(body, api)]


def witness_pairs(body: Any, api: str) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in witness.dialogue(witness.conversation(body, api))]


# ---------------------------------------------------------------- hand-built, per shape

REMINDER = "<system-reminder>\nThe date is 2026-12-01.\n</system-reminder>"


def test_anthropic_text_tools_system_entries_and_reminders() -> None:
    body = {"system": [{"type": "text", "text": "You are Claude Code"}], "messages": [
        {"role": "user", "content": [{"type": "text", "text": REMINDER}, {"type": "text", "text": "first question"}]},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"},
                                          {"type": "text", "text": "let me look"},
                                          {"type": "tool_use", "id": "t1", "name": "Bash", "input": {"command": "ls"}},
                                          {"type": "text", "text": "after the tool"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]},
        {"role": "system", "content": "mid-conversation system entry"},
        {"role": "user", "content": f"{REMINDER}\n\nsecond\nquestion"},
        {"role": "assistant", "content": "plain string reply"},
    ]}
    assert pairs(body, "anthropic") == [("user", "first question"), ("assistant", "let me look"),
                                        ("assistant", "after the tool"), ("user", "second\nquestion"),
                                        ("assistant", "plain string reply")]
    assert digest_of(text_messages(body, "anthropic"))[0] == DigestEntry(role="user", sha256=sha("first question"))


def test_claude_merged_failed_prompt_is_the_concatenation_of_its_blocks() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "FAILME please\n"},
                                                      {"type": "text", "text": "after failure"}]}]}
    assert pairs(body, "anthropic") == [("user", "FAILME please\nafter failure")]


def test_responses_codex_context_developer_and_items() -> None:
    body = {"input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "sandbox rules"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>\n"
                                                         "<cwd>/w</cwd></environment_context>"}]},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "  # AGENTS.md instructions for /w"},
            {"type": "input_text", "text": "real question"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "an answer"}]},
        {"type": "function_call", "name": "exec_command", "arguments": "{}", "call_id": "c1"},
        {"type": "function_call_output", "call_id": "c1", "output": "done"},
        {"role": "user", "content": "no type: a message"},
    ]}
    assert pairs(body, "responses") == [("user", "real question"), ("assistant", "an answer"),
                                        ("user", "no type: a message")]
    assert pairs({"input": "just a string <system-reminder>x</system-reminder>"}, "responses") == [
        ("user", "just a string <system-reminder>x</system-reminder>")]  # a string input is taken as is


def test_chat_kilo_environment_details_and_empty_assistant() -> None:
    env = "\n\n<environment_details>\nMessage time: now\nWorking directory: /w\n</environment_details>"
    body = {"messages": [
        {"role": "system", "content": "You are OpenCode"},
        {"role": "user", "content": [{"type": "text", "text": "hello"}, {"type": "text", "text": env}]},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "c", "function": {"name": "bash", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c", "content": "out"},
        {"role": "assistant", "content": [{"type": "text", "text": "re"}, {"type": "text", "text": "ply"}]},
        {"role": "user", "content": "suffix" + env},
        {"role": "user", "content": "<environment_details>mid</environment_details> is the user's own text"},
    ]}
    assert pairs(body, "chat") == [("user", "hello"), ("assistant", "reply"), ("user", "suffix"),
                                   ("user", "<environment_details>mid</environment_details> is the user's own text")]


@pytest.mark.parametrize("text,expected", [
    ("plain", "plain"),
    (" keeps  whitespace \n", " keeps  whitespace \n"),
    (f"{REMINDER}", ""),
    (f"{REMINDER}\r\n\r\nafter", "after"),
    (f"before\n\n{REMINDER}", "before"),
    (f"a\n{REMINDER}\n\n{REMINDER}\nb", "ab"),
    ("<system-reminder>unterminated", "<system-reminder>unterminated"),
    ("x\n\n<environment_details>\nd\n</environment_details>\n", "x"),
])
def test_strip_annotations(text: str, expected: str) -> None:
    assert strip_annotations(text) == expected
    assert witness.strip_annotations(text) == expected


def test_classification_of_side_requests() -> None:
    title = {"messages": [{"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
                          {"role": "user", "content": "Generate a title for this conversation:\n"}]}
    assert classify(title, "chat") == "title"
    assert classify({**title, "tools": [{"name": "bash"}]}, "chat") == "conversation"
    summary = {"input": [{"role": "user", "content": "CONTEXT CHECKPOINT COMPACTION"}]}
    assert classify(summary, "responses") == "summary"
    sub = {"system": "You are an agent for Claude Code, …", "messages": []}
    assert classify(sub, "anthropic") == "subagent"
    assert classify({"messages": "not a list"}, "anthropic") == "other"
    assert classify([1, 2], "chat") == "other"
    assert classify({"messages": []}, "anthropic") == "conversation"


def test_decode_body_errors_name_the_problem() -> None:
    import gzip

    assert decode_body(gzip.compress(b'{"a": 1}'), "gzip") == {"a": 1}
    with pytest.raises(DigestError, match="not JSON"):
        decode_body(b"{nope", None)
    with pytest.raises(DigestError, match="zstd"):
        decode_body(b"...", "zstd")
    with pytest.raises(DigestError, match="not valid gzip"):
        decode_body(b"not gzip", "gzip")
    with pytest.raises(DigestError, match="not JSON"):
        decode_body(b"[" * 100_000, None)  # nesting deeper than the parser's recursion limit


def test_lone_surrogates_hash() -> None:
    body = json.loads('{"messages": [{"role": "user", "content": "bad \\ud800 half"}]}')
    [entry] = digest_of(text_messages(body, "chat"))
    assert entry.role == "user" and len(entry.sha256) == 64


# ---------------------------------------------------------------- the real CLIs' requests


@pytest.mark.parametrize("path", sorted(DATA.glob("*.jsonl")), ids=lambda p: p.stem)
def test_recorded_requests_digest_exactly_like_the_witness(path: Path) -> None:
    """Every request the pinned CLIs sent (tests/data/loopback): same text messages, same kind."""
    checked = 0
    for rec in load_jsonl(path):
        if rec.api not in ("anthropic", "responses", "chat") or not isinstance(rec.body, dict):
            continue
        assert pairs(rec.body, rec.api) == witness_pairs(rec.body, rec.api), (path.name, rec.seq)
        if rec.kind != "other":
            assert classify(rec.body, rec.api) == rec.kind, (path.name, rec.seq)
        checked += 1
    assert checked >= 2


# ---------------------------------------------------------------- properties

_text = st.lists(st.sampled_from(list(string.ascii_letters[:6] + " \n\r\t")
                                 + ["<system-reminder>", "</system-reminder>", "<environment_details>",
                                    "</environment_details>", "<environment_context>", "é", "\u2028"]),
                 max_size=12).map("".join)
_json = st.recursive(st.none() | st.booleans() | st.integers() | _text,
                     lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(
                         ["role", "content", "type", "text", "messages", "input", "tools", "system"]), inner,
                         max_size=4), max_leaves=20)
_role = st.sampled_from(["user", "assistant", "system", "developer", "tool", None, 3])
_part = st.fixed_dictionaries({"type": st.sampled_from(["text", "input_text", "output_text", "tool_use",
                                                        "tool_result", "thinking", None]), "text": _text | st.none()})
_content = _text | st.lists(_part, max_size=4)
_message = st.fixed_dictionaries({"role": _role, "content": _content},
                                 optional={"type": st.sampled_from(["message", "function_call", "reasoning"])})
_body = st.fixed_dictionaries({"messages": st.lists(_message, max_size=6), "input": st.lists(_message, max_size=6)},
                              optional={"system": _content, "tools": st.lists(st.just({"n": 1}), max_size=1)})


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(body=_body, api=st.sampled_from(["anthropic", "responses", "chat"]))
def test_well_formed_bodies_agree_with_the_witness(body: dict[str, Any], api: str) -> None:
    assert pairs(body, api) == witness_pairs(body, api)
    assert classify(body, api) == witness.classify(body, api)


@settings(max_examples=400, deadline=None)
@given(body=_json, api=st.sampled_from(["anthropic", "responses", "chat", "other"]))
def test_any_json_never_crashes(body: Any, api: str) -> None:
    digest = digest_of(text_messages(body, api))
    assert all(e.role in ("user", "assistant") for e in digest)
    classify(body, api)


@settings(max_examples=300, deadline=None)
@given(raw=st.binary(max_size=200), encoding=st.sampled_from([None, "gzip", "deflate", "br", "identity"]))
def test_any_bytes_give_a_digest_or_a_digest_error(raw: bytes, encoding: str | None) -> None:
    try:
        body = decode_body(raw, encoding)
    except DigestError:
        return
    for api in ("anthropic", "responses", "chat"):
        digest_of(text_messages(body, api))
        classify(body, api)


def test_digest_entries_are_equal_exactly_when_role_and_digest_are() -> None:
    a = DigestEntry.text("user", "same text")
    assert a == DigestEntry(role="user", sha256=sha("same text"))
    assert a != DigestEntry.text("assistant", "same text")  # the role counts
    assert a != DigestEntry.text("user", "other text")
    assert a != ("user", sha("same text"))  # only another entry compares equal
    assert len({a, DigestEntry.text("user", "same text"), DigestEntry.text("assistant", "same text")}) == 2
    assert [a, DigestEntry.text("assistant", "x")] == [DigestEntry.text("user", "same text"), DigestEntry.text("assistant", "x")]


def test_a_digest_entry_keeps_its_json_and_is_validated_where_a_record_is_read() -> None:
    """DigestEntry is a slotted dataclass (a long chat's request carries hundreds): its JSON,
    its schema and its validation are still a model's, so stored records read the same."""
    rec = WireRecord(seq=1, chat_key="k", member_key="mk", job_id="j", started_at=datetime(2026, 12, 6, tzinfo=UTC),
                     duration_ms=1.0, method="POST", path="/v1/messages", route="anthropic.messages",
                     api="anthropic", kind="conversation", side=False, status=200, bytes_in=1, bytes_out=1,
                     digest=[DigestEntry.text("user", "hi"), DigestEntry.text("assistant", "hello")])
    stored = json.loads(rec.model_dump_json())
    assert stored["digest"] == [{"role": "user", "sha256": sha("hi")}, {"role": "assistant", "sha256": sha("hello")}]
    assert WireRecord.model_validate_json(rec.model_dump_json()) == rec
    entry = WireRecord.model_json_schema()["$defs"]["DigestEntry"]
    assert entry["required"] == ["role", "sha256"]
    assert entry["properties"]["sha256"]["pattern"] == "^[0-9a-f]{64}$"
    assert entry["properties"]["role"]["enum"] == ["user", "assistant"]
    for bad, field, kind in ((sha("x")[:63], "sha256", "string_pattern_mismatch"), ("system", "role", "literal_error")):
        wrong = dict(stored, digest=[{"role": "user", "sha256": sha("hi")},
                                     {"role": "assistant", "sha256": sha("hello")} | {field: bad}])
        with pytest.raises(ValidationError) as caught:
            WireRecord.model_validate_json(json.dumps(wrong))
        assert [(e["loc"], e["type"]) for e in caught.value.errors()] == [(("digest", 1, field), kind)]
