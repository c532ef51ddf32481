"""The wire verdict (SPEC 12): new | complete | gap | compacted | none, first_difference, and
the named per-CLI tolerances — over hand-built records of all three API shapes."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any

import pytest

from proxy.audit import audit_request
from proxy.records import DigestEntry, WireRecord
from proxy.routes import match
from proxy.verdict import (
    FOLDS_FAILED_QUERY,
    TOLERANCES,
    Baseline,
    baseline_after,
    tolerances_for,
    wire_verdict,
)

_seq = iter(range(1, 10_000))


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def U(text: str) -> DigestEntry:
    return DigestEntry.text("user", text)


def A(text: str) -> DigestEntry:
    return DigestEntry.text("assistant", text)


def body_for(api: str, history: list[tuple[str, str]]) -> dict[str, Any]:
    """A request body of shape ``api`` carrying ``history``, with each CLI's annotations."""
    if api == "anthropic":
        msgs: list[dict[str, Any]] = []
        for role, text in history:
            content = [{"type": "text", "text": "<system-reminder>ctx</system-reminder>"}] if role == "user" else []
            msgs.append({"role": role, "content": [*content, {"type": "text", "text": text}]})
        return {"system": "You are Claude Code", "messages": msgs, "tools": [{"name": "Bash"}], "stream": True}
    if api == "responses":
        items: list[dict[str, Any]] = [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "<environment_context>"}]}]
        for role, text in history:
            part = "input_text" if role == "user" else "output_text"
            items.append({"type": "message", "role": role, "content": [{"type": part, "text": text}]})
        return {"input": items, "tools": [{"name": "exec_command"}], "stream": True}
    msgs = [{"role": "system", "content": "You are OpenCode"}]
    for role, text in history:
        env = [{"type": "text", "text": "\n\n<environment_details>x</environment_details>"}] if role == "user" else []
        msgs.append({"role": role, "content": [{"type": "text", "text": text}, *env]})
    return {"messages": msgs, "tools": [{"type": "function"}], "stream": True}


ROUTE = {"anthropic": ("POST", "/v1/messages"), "responses": ("POST", "/v1/responses"),
         "chat": ("POST", "/v1/chat/completions")}


def record(api: str, history: list[tuple[str, str]], *, reply: str | None = None, body: dict | None = None,
           status: int = 200) -> WireRecord:
    """A record built the way the proxy builds it: the body is audited by proxy.audit."""
    import json

    route = match(*ROUTE[api])
    assert route is not None
    audit = audit_request(json.dumps(body or body_for(api, history)).encode(), None, route, capture=False)
    return WireRecord(seq=next(_seq), chat_key="c", member_key="m", job_id="j", started_at=datetime.now(UTC),
                      duration_ms=1.0, method="POST", path=route.path, route=route.name, api=route.api,
                      kind=audit.kind, side=audit.kind != "conversation", status=status, bytes_in=1, bytes_out=1,
                      digest=audit.digest, reply=[A(reply)] if reply is not None else None)


def probe() -> WireRecord:
    route = match("HEAD", "/api/hello")
    assert route is not None
    return WireRecord(seq=next(_seq), chat_key="c", member_key="m", job_id="j", started_at=datetime.now(UTC),
                      duration_ms=1.0, method="HEAD", path=route.path, route=route.name, api=None, kind="probe",
                      side=True, status=200, bytes_in=0, bytes_out=0)


H1 = [("user", "u1"), ("assistant", "a1"), ("user", "u2")]
PREV = Baseline(conversation=[U("u1"), A("a1"), U("u2")], reply=[A("a2")])
APIS = ["anthropic", "responses", "chat"]


@pytest.mark.parametrize("api", APIS)
def test_complete_when_the_turn_starts_with_the_history_and_its_reply(api: str) -> None:
    recs = [probe(), record(api, [*H1, ("assistant", "a2"), ("user", "u3")], reply="a3")]
    v = wire_verdict(recs, baseline=PREV, message="u3")
    assert (v.requests, v.side_requests, v.history, v.first_difference) == (2, 1, "complete", None)


@pytest.mark.parametrize("api", APIS)
def test_gap_names_the_first_index_and_role_that_differ(api: str) -> None:
    dropped = [("user", "u1"), ("user", "u2"), ("assistant", "a2"), ("user", "u3")]  # a1 missing
    v = wire_verdict([record(api, dropped)], baseline=PREV, message="u3")
    assert v.history == "gap"
    d = v.first_difference
    assert d is not None
    assert (d.index, d.role, d.expected_digest, d.observed_digest, d.check) == (1, "assistant", sha("a1"), sha("u2"),
                                                                                "history")


def test_edited_message_is_a_gap_at_its_index() -> None:
    edited = [("user", "u1"), ("assistant", "a1"), ("user", "u2 EDITED"), ("assistant", "a2"), ("user", "u3")]
    d = wire_verdict([record("chat", edited)], baseline=PREV, message="u3").first_difference
    assert d is not None and (d.index, d.role, d.observed_digest) == (2, "user", sha("u2 EDITED"))


def test_truncated_history_names_the_missing_index_with_no_observed_digest() -> None:
    v = wire_verdict([record("anthropic", [("user", "u3")])], baseline=PREV, message="u3")
    d = v.first_difference
    assert v.history == "gap" and d is not None
    assert (d.index, d.role, d.expected_digest, d.observed_digest) == (0, "user", sha("u1"), sha("u3"))
    v = wire_verdict([record("anthropic", [("user", "u1")])], baseline=PREV, message="u3")
    d = v.first_difference
    assert d is not None and (d.index, d.role, d.observed_digest) == (1, "assistant", None)


def test_the_last_user_text_must_be_the_jobs_message_unchanged() -> None:
    recs = [record("responses", [*H1, ("assistant", "a2"), ("user", "u3 plus a supervisor note")])]
    v = wire_verdict(recs, baseline=PREV, message="u3")
    d = v.first_difference
    assert v.history == "gap" and d is not None
    assert (d.index, d.role, d.expected_digest, d.observed_digest, d.check) == (
        4, "user", sha("u3"), sha("u3 plus a supervisor note"), "message")
    # no new user message at all: the difference is where the message should be
    d = wire_verdict([record("responses", [*H1, ("assistant", "a2")])], baseline=PREV, message="u3").first_difference
    assert d is not None and (d.index, d.role, d.observed_digest, d.check) == (4, "user", None, "message")


def test_each_later_request_must_extend_the_one_before() -> None:
    first = record("anthropic", [*H1, ("assistant", "a2"), ("user", "u3")])
    retry = record("anthropic", [*H1, ("assistant", "a2"), ("user", "u3")], status=200)  # same: extends
    after_tool = record("anthropic", [*H1, ("assistant", "a2"), ("user", "u3"), ("assistant", "let me look")])
    assert wire_verdict([first, retry, after_tool], baseline=PREV, message="u3").history == "complete"
    shrunk = record("anthropic", [("user", "summary"), ("user", "u3")])
    v = wire_verdict([first, shrunk], baseline=PREV, message="u3")
    d = v.first_difference
    assert v.history == "gap" and d is not None
    assert (d.index, d.role, d.check, d.request_seq) == (0, "user", "extension", shrunk.seq)


def test_compacted_is_a_gap_the_driver_saw_the_cli_compact() -> None:
    summary = record("responses", [("user", "u1"), ("user", "CONTEXT CHECKPOINT COMPACTION")])
    assert summary.kind == "summary" and summary.side
    after = record("responses", [("user", "u1"), ("user", "summary of it all"), ("user", "u3")])
    v = wire_verdict([summary, after], baseline=PREV, message="u3", compaction=True)
    assert (v.history, v.requests, v.side_requests) == ("compacted", 2, 1)
    assert v.first_difference is not None and v.first_difference.index == 1
    assert wire_verdict([summary, after], baseline=PREV, message="u3").history == "gap"


def test_new_and_none() -> None:
    assert wire_verdict([record("chat", [("user", "hi")])], baseline=None, message="hi").history == "new"
    v = wire_verdict([probe()], baseline=PREV, message="u3")
    assert (v.history, v.requests, v.side_requests) == ("none", 1, 1)
    assert wire_verdict([], baseline=PREV, message="u3").model_dump() == {
        "requests": 0, "side_requests": 0, "history": "none", "first_difference": None, "tolerances": []}


def test_side_requests_are_not_compared() -> None:
    title = record("chat", [], body={"messages": [
        {"role": "system", "content": "You are a title generator."},
        {"role": "user", "content": "Generate a title for this conversation:\n"}]})
    assert title.kind == "title"
    main = record("chat", [*H1, ("assistant", "a2"), ("user", "u3")])
    v = wire_verdict([title, main], baseline=PREV, message="u3")
    assert (v.history, v.requests, v.side_requests) == ("complete", 2, 1)


def test_fork_compares_with_the_source_at_the_fork_point() -> None:
    fork_point = Baseline(conversation=[U("u1")], reply=[A("a1")])
    recs = [record("anthropic", [("user", "u1"), ("assistant", "a1"), ("user", "fork question")])]
    assert wire_verdict(recs, baseline=fork_point, message="fork question").history == "complete"
    assert wire_verdict(recs, baseline=PREV, message="fork question").history == "gap"


# ---------------------------------------------------------------- after a settled failure


def test_baseline_after_keeps_the_reply_only_when_the_turn_succeeded() -> None:
    recs = [probe(), record("chat", [("user", "u1")], reply="ignored"), record("chat", [("user", "u1")], reply="a1")]
    assert baseline_after(recs, succeeded=True) == Baseline(conversation=[U("u1")], reply=[A("a1")])
    assert baseline_after(recs, succeeded=False) == Baseline(conversation=[U("u1")], reply=[])
    assert baseline_after([probe()], succeeded=True) is None


@pytest.mark.parametrize("api", APIS)
def test_other_clis_keep_the_failed_prompt_as_its_own_message(api: str) -> None:
    failed = baseline_after([record(api, [("user", "u1"), ("assistant", "a1"), ("user", "bad")], status=400)],
                            succeeded=False)
    recs = [record(api, [("user", "u1"), ("assistant", "a1"), ("user", "bad"), ("user", "next")])]
    for runtime in ("codex", "pi", "opencode", "kilo"):
        v = wire_verdict(recs, baseline=failed, message="next", failed_before=["bad"], runtime=runtime)
        assert (v.history, v.tolerances) == ("complete", [])


def test_claude_folds_the_failed_query_into_the_next_user_text() -> None:
    """Claude 2.1.220 sends "<failed>\\n<next>" (the named tolerance FOLDS_FAILED_QUERY)."""
    failed = baseline_after([record("anthropic", [("user", "u1"), ("assistant", "a1"), ("user", "bad")], status=400)],
                            succeeded=False)
    folded = record("anthropic", [("user", "u1"), ("assistant", "a1"), ("user", "bad\nnext")])
    v = wire_verdict([folded], baseline=failed, message="next", failed_before=["bad"], runtime="claude")
    assert (v.history, v.tolerances) == ("complete", ["folds_failed_query"])
    # the tolerance is Claude's alone
    v = wire_verdict([folded], baseline=failed, message="next", failed_before=["bad"], runtime="codex")
    assert v.history == "gap" and v.first_difference is not None and v.first_difference.index == 2
    # it tolerates the failed query carried verbatim, nothing else
    altered = record("anthropic", [("user", "u1"), ("assistant", "a1"), ("user", "ba\nnext")])
    v = wire_verdict([altered], baseline=failed, message="next", failed_before=["bad"], runtime="claude")
    assert v.history == "gap" and v.tolerances == []
    # and it needs a failure before
    v = wire_verdict([folded], baseline=failed, message="next", runtime="claude")
    assert v.history == "gap"


def test_claude_chains_several_failed_queries() -> None:
    first_fail = record("anthropic", [("user", "u1"), ("assistant", "a1"), ("user", "f1")], status=400)
    base = baseline_after([first_fail], succeeded=False)
    second_fail = record("anthropic", [("user", "u1"), ("assistant", "a1"), ("user", "f1\nf2")], status=400)
    assert wire_verdict([second_fail], baseline=base, message="f2", failed_before=["f1"],
                        runtime="claude").history == "complete"
    base = baseline_after([second_fail], succeeded=False)
    follow = record("anthropic", [("user", "u1"), ("assistant", "a1"), ("user", "f1\nf2\nnext")])
    v = wire_verdict([follow], baseline=base, message="next", failed_before=["f1", "f2"], runtime="claude")
    assert (v.history, v.tolerances) == ("complete", ["folds_failed_query"])


def test_tolerances_are_named_and_per_cli() -> None:
    assert [t.name for t in TOLERANCES] == ["folds_failed_query"]
    assert tolerances_for("claude") == [FOLDS_FAILED_QUERY]
    assert all(tolerances_for(r) == [] for r in ("codex", "pi", "opencode", "kilo", None))
