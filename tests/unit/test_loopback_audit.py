"""Audit of real recorded requests (tests/data/loopback/, captured from the pinned CLIs) and the
history comparison that CI prints on failure."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.loopback import (
    JOINER,
    Message,
    assert_history,
    classify,
    compare_history,
    conversation,
    dialogue,
    expected_default_reply,
    load_jsonl,
    strip_annotations,
    user_texts,
)

DATA = Path(__file__).resolve().parents[1] / "data" / "loopback"
U, A = Message.user, Message.assistant


def records(name: str):
    return load_jsonl(DATA / name)


def last_conversation(name: str):
    return [r for r in records(name) if r.kind == "conversation"][-1]


def test_every_recorded_kind_is_reclassified_the_same() -> None:
    for path in DATA.glob("*.jsonl"):
        for rec in load_jsonl(path):
            if rec.status != 400 or rec.kind != "other":
                assert classify(rec.body, rec.api, rec.method) == rec.kind, (path.name, rec.seq)


def test_default_replies_survive_the_round_trip_through_each_cli() -> None:
    """Every default reply the fixture sent comes back verbatim in the next requests' history."""
    for path in DATA.glob("*.jsonl"):
        recs = load_jsonl(path)
        if any(r.kind == "summary" for r in recs):
            continue  # compaction rewrites the history the CLI sends afterwards
        convs = [r for r in recs if r.kind == "conversation"]
        sent = {r.reply_text for r in convs if r.action == "default"}
        final = dialogue(convs[-1].conversation())
        for i, m in enumerate(final):
            if m.role == "assistant" and m.text.startswith("ok "):
                assert m.text == expected_default_reply(user_texts(final[:i])), (path.name, i)
                assert m.text in sent


def test_claude_conversation_strips_reminders_and_system_entries() -> None:
    rec = last_conversation("claude-2.1.220.jsonl")
    raw_first = rec.body["messages"][0]["content"]
    assert raw_first[0]["text"].startswith("<system-reminder>")  # the real shape
    assert any(m["role"] == "system" for m in rec.body["messages"])
    assert dialogue(rec.conversation()) == [
        U("please runtool now"), A("tool finished"), U("spawn a subagent"), A("sub finished"),
        # the rejected message is merged into the next one; Claude ends it with "\n" itself
        U("FAILME please\nafter failure"),
    ]
    conv = rec.conversation()
    assert [m.role for m in conv].count("tool_call") == 2
    bash = next(m for m in conv if m.role == "tool_call")
    assert bash.name == "Bash" and bash.call_id and '"command"' in bash.text
    result = next(m for m in conv if m.role == "tool_result")
    assert result.text == "hi-from-tool" and result.call_id == bash.call_id


def test_claude_side_requests() -> None:
    recs = records("claude-2.1.220.jsonl")
    assert recs[0].kind == "probe" and recs[0].method == "HEAD" and recs[0].path == "/api/hello"
    (sub,) = [r for r in recs if r.kind == "subagent"]
    assert dialogue(sub.conversation()) == [U("subagent prompt text")]
    assert sub.headers.get("x-claude-code-agent-id")


def test_codex_conversation_drops_developer_and_environment_context() -> None:
    rec = last_conversation("codex-0.171.0.jsonl")
    roles = [(i.get("role"), i.get("type")) for i in rec.body["input"][:3]]
    assert roles == [("developer", "message"), ("developer", "message"), ("user", "message")]
    assert rec.body["input"][2]["content"][0]["text"].startswith("<environment_context>")
    d = dialogue(rec.conversation())
    assert [m.role for m in d] == ["user", "assistant", "user", "assistant", "user", "assistant", "user"]
    assert d[0] == U("hello codex") and d[2] == U("please runtool now") and d[3] == A("tool finished")
    # whitespace inside and at the end of a message is kept byte for byte
    assert d[-1] == U("after  failure\n\npara")
    call = next(m for m in rec.conversation() if m.role == "tool_call")
    assert call.name == "exec_command" and '"cmd"' in call.text


def test_pi_conversation_keeps_the_failed_user_message() -> None:
    d = dialogue(last_conversation("pi-0.73.1.jsonl").conversation())
    assert d == [U("hello pi"), A(expected_default_reply(["hello pi"])), U("please runtool now"),
                 A("tool finished"), U("FAILME please"), U("after failure")]


def test_opencode_title_request_and_conversation() -> None:
    recs = records("opencode-1.18.33.jsonl")
    (title,) = [r for r in recs if r.kind == "title"]
    assert not title.body.get("tools") and title.reply_text == "Fixture Title"
    d = dialogue(recs[-1].conversation())
    assert d[0] == U("hello opencode") and d[-2:] == [U("FAILME please"), U("after failure")]


def test_kilo_environment_details_part_is_stripped() -> None:
    rec = last_conversation("kilo-7.7.7.jsonl")
    first_user = next(m for m in rec.body["messages"] if m["role"] == "user")
    assert first_user["content"][1]["text"].startswith("\n\n<environment_details>")
    d = dialogue(rec.conversation())
    assert d[0] == U("hello kilo") and d[-1] == U("after failure")
    assert not any("environment_details" in m.text for m in d)


# ---------------------------------------------------------------- annotation stripping, synthetic


def test_strip_annotations() -> None:
    reminder = "<system-reminder>\nctx\n</system-reminder>"
    assert strip_annotations(reminder + "\n\n") == ""
    assert strip_annotations(reminder + "\n\nhello") == "hello"
    assert strip_annotations("hello\n\n" + reminder) == "hello"
    assert strip_annotations("a " + reminder + " b") == "a  b"
    assert strip_annotations("  keep  \n") == "  keep  \n"
    env = "\n\n<environment_details>\nMessage time: x\n</environment_details>"
    assert strip_annotations("text" + env) == "text"
    assert strip_annotations(env) == ""


def test_single_block_round_trips_and_blocks_are_joined_exactly() -> None:
    text = "\n  leading and trailing  \n\nsecond paragraph\t\n"
    for api, body in [
        ("anthropic", {"messages": [{"role": "user", "content": [{"type": "text", "text": text}]}]}),
        ("responses", {"input": [{"role": "user", "content": [{"type": "input_text", "text": text}]}]}),
        ("chat", {"messages": [{"role": "user", "content": text}]}),
    ]:
        assert conversation(body, api) == [U(text)]
    assert JOINER == ""
    two = {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\n"}, {"type": "text", "text": "b"}]}]}
    assert conversation(two, "anthropic") == [U("a\nb")]


def test_codex_markers_and_chat_system_messages() -> None:
    body = {"instructions": "sys", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "dev"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "# AGENTS.md instructions for /w\n\nx"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<user_instructions>x</user_instructions>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "real"}]},
        {"type": "reasoning", "summary": []},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<turn_aborted>\nThe user interrupted\n</turn_aborted>"}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "next"}]},
    ]}
    assert conversation(body, "responses") == [U("real"), U("next")]
    assert conversation({"input": "just text"}, "responses") == [U("just text")]
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "developer", "content": "d"},
                         {"role": "user", "content": "u"}, {"role": "assistant", "content": [{"type": "text", "text": "a"}]}]}
    assert conversation(chat, "chat") == [U("u"), A("a")]


def test_anthropic_role_system_and_thinking_blocks() -> None:
    body = {"system": [{"type": "text", "text": "x"}], "messages": [
        {"role": "user", "content": "u1"},
        {"role": "system", "content": "mid-conversation system"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "hmm"}, {"type": "text", "text": "a1"}]},
        {"role": "user", "content": [{"type": "text", "text": "<system-reminder>r</system-reminder>"}]},
    ]}
    assert conversation(body, "anthropic") == [U("u1"), A("a1")]


def test_classify() -> None:
    assert classify(None, "head", "HEAD") == "probe"
    assert classify({"messages": []}, "other") == "other"
    summary = {"messages": [{"role": "system", "content": "You are a context summarization assistant."}]}
    assert classify(summary, "chat") == "summary"
    claude_compact = {"messages": [{"role": "user", "content": "Your task is to create a detailed summary of the conversation so far"}]}
    assert classify(claude_compact, "anthropic") == "summary"
    kilo_title = {"messages": [{"role": "user", "content": "Generate a title for this conversation:\n\nTitle the task"}]}
    assert classify(kilo_title, "chat") == "title"
    # with tools it is a conversation that merely quotes the phrase
    assert classify({**kilo_title, "tools": [{"type": "function"}]}, "chat") == "conversation"


# ---------------------------------------------------------------- compare_history


def test_identical_histories() -> None:
    h = [U("u1"), A("a1"), U("u2")]
    diff = compare_history(h, list(h))
    assert diff.ok and bool(diff) and str(diff) == "history OK (3 messages)"


def test_tool_entries_are_ignored_by_default() -> None:
    obs = [U("u1"), Message(role="tool_call", text="{}", name="bash"), Message(role="tool_result", text="x"), A("a1")]
    assert compare_history([U("u1"), A("a1")], obs).ok
    assert not compare_history([U("u1"), A("a1")], obs, roles=("user", "assistant", "tool_call")).ok


def test_missing_message() -> None:
    diff = compare_history([U("u1"), A("a1"), U("u2")], [U("u1"), U("u2")])
    assert not diff.ok
    assert [d.kind for d in diff.differences] == ["missing"]
    text = str(diff)
    assert "missing  expected[1] assistant: 'a1'" in text
    assert text.splitlines()[0] == "history differs: 1 difference(s)"
    assert "observed:\n  [0] user: 'u1'\n  [1] user: 'u2'" in text


def test_extra_message() -> None:
    diff = compare_history([U("u1"), U("u2")], [U("u1"), A("surprise"), U("u2")])
    assert [d.kind for d in diff.differences] == ["extra"]
    assert "extra    observed[1] assistant: 'surprise'" in str(diff)


def test_changed_text_points_at_the_first_difference() -> None:
    diff = compare_history([U("u1"), A("the answer is 42")], [U("u1"), A("the answer is 43 ")])
    (d,) = diff.differences
    assert d.kind == "changed"
    assert "changed  expected[1] vs observed[1] (assistant): first difference at char 15" in str(diff)
    assert "(lengths 16 vs 17)" in str(diff)


def test_whitespace_change_is_a_difference() -> None:
    assert not compare_history([U("hello")], [U("hello\n")]).ok


def test_reordered_messages() -> None:
    diff = compare_history([U("u1"), A("a1"), U("u2"), A("a2")], [U("u2"), A("a2"), U("u1"), A("a1")])
    assert {d.kind for d in diff.differences} == {"reordered"}
    assert "reordered user: 'u1': expected at [0], observed at [2]" in str(diff) or \
        "reordered user: 'u2': expected at [2], observed at [0]" in str(diff)


def test_occurrence_counts() -> None:
    # the same question asked twice must appear twice
    diff = compare_history([U("again"), A("x"), U("again"), A("x")], [U("again"), A("x")])
    kinds = [d.kind for d in diff.differences]
    assert kinds.count("count") == 2 and kinds.count("missing") == 2
    text = str(diff)
    assert text.index("count    user: 'again'") < text.index("count    assistant: 'x'")
    assert "count    user: 'again': expected 2 occurrence(s), observed 1" in text
    assert "count    assistant: 'x': expected 2 occurrence(s), observed 1" in text
    diff = compare_history([U("once")], [U("once"), U("once")])
    assert [d.kind for d in diff.differences] == ["count", "extra"]


def test_role_change_is_missing_plus_extra() -> None:
    diff = compare_history([U("x")], [A("x")])
    assert sorted(d.kind for d in diff.differences) == ["extra", "missing"]


def test_assert_history_raises_with_the_readable_text() -> None:
    with pytest.raises(AssertionError) as exc:
        assert_history([U("a")], [U("b")])
    assert "history differs" in str(exc.value) and "expected:" in str(exc.value)


# ---------------------------------------------------------------- side requests recorded from real CLIs


def test_claude_reactive_compaction_summary_request() -> None:
    """A context-window refusal makes Claude compact: the summary request is a side request."""
    recs = records("claude-2.1.220-compaction.jsonl")
    assert [r.kind for r in recs] == ["probe", "conversation", "conversation", "conversation", "summary",
                                      "conversation", "conversation"]
    refused = recs[3]
    assert refused.status == 400 and refused.action == "reject"
    # leading and trailing whitespace of a user message survive Claude byte for byte
    assert dialogue(recs[1].conversation()) == [U("  padded  \n")]
    summary = recs[4]
    assert summary.reply_text and summary.reply_text.startswith("Fixture summary")


def test_pi_overflow_compaction_summary_request() -> None:
    recs = records("pi-0.73.1-compaction.jsonl")
    kinds = [r.kind for r in recs]
    assert kinds.count("summary") == 1 and kinds[kinds.index("summary") - 1] == "conversation"
    (summary,) = [r for r in recs if r.kind == "summary"]
    assert summary.body["messages"][0]["content"].startswith("You are a context summarization assistant")
    assert not summary.body.get("tools")
    assert dialogue(recs[0].conversation()) == [U("  padded  \n")]


def test_kilo_title_request_after_the_second_user_message() -> None:
    recs = records("kilo-7.7.7-title.jsonl")
    assert [r.kind for r in recs] == ["conversation", "conversation", "title"]
    title = recs[-1]
    assert title.reply_text == "Fixture Title" and not title.body.get("tools")
    assert dialogue(recs[1].conversation()) == [U("  padded  \n"), A(expected_default_reply(["  padded  \n"])),
                                                U("normal one")]
