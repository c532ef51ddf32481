"""Behaviour script: every rule and injected failure, in each API shape where the shape matters."""

from __future__ import annotations

import json
import re
import socket
import threading
import time

import httpx
import pytest

from deploy.loopback import (
    TITLE_REPLY,
    LoopbackFixture,
    Rule,
    context_too_long,
    cut,
    expected_default_reply,
    fail,
    recall,
    reject,
    reply,
    shell_call,
    stall,
    tool_call,
)
from deploy.loopback.behaviour import ANTHROPIC_CONTEXT_MESSAGE, OPENAI_CONTEXT_MESSAGE, TERMINAL_MESSAGE
from deploy.loopback.sse import parse_sse

# Substrings that make pi 0.73.1 auto-retry an error (protocols/pi.md §6).
PI_RETRYABLE = re.compile(
    r"overloaded|provider returned error|rate limit|too many requests|429|500|502|503|504|service unavailable|"
    r"server error|internal error|network error|connection|websocket|other side closed|fetch failed|"
    r"upstream connect|reset before headers|socket hang up|ended without|http2|timed out|timeout|terminated|"
    r"retry delay", re.IGNORECASE)

PATHS = {"anthropic": "/v1/messages?beta=true", "responses": "/v1/responses", "chat": "/v1/chat/completions"}
SHELL_TOOLS = {
    "anthropic": [{"name": "Read", "input_schema": {}},
                  {"name": "Bash", "input_schema": {"type": "object", "properties": {"command": {}, "description": {}},
                                                    "required": ["command"]}}],
    "responses": [{"type": "function", "name": "exec_command",
                   "parameters": {"type": "object", "properties": {"cmd": {}, "workdir": {}}, "required": ["cmd"]}}],
    "chat": [{"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {}, "description": {}}, "required": ["command", "description"]}}}],
}


def body(api: str, users: list[str], *, tools: bool = True, extra: list | None = None) -> dict:
    if api == "responses":
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": u}]} for u in users]
        b: dict = {"model": "m", "stream": True, "input": items + (extra or [])}
    else:
        b = {"model": "m", "stream": True, "messages": [{"role": "user", "content": u} for u in users] + (extra or [])}
    if tools:
        b["tools"] = SHELL_TOOLS[api]
    return b


def stream(fx: LoopbackFixture, api: str, b: dict) -> tuple[int, dict, list]:
    resp = httpx.post(fx.base_url + PATHS[api], json=b, timeout=10)
    if resp.status_code != 200:
        return resp.status_code, dict(resp.headers), [resp.json()]
    evs = [(n, d if d == "[DONE]" else json.loads(d)) for n, d in parse_sse(resp.text)]
    return 200, dict(resp.headers), evs


def text_of(api: str, evs: list) -> str:
    if api == "anthropic":
        return "".join(d["delta"].get("text", "") for n, d in evs if n == "content_block_delta")
    if api == "responses":
        return "".join(d["delta"] for n, d in evs if n == "response.output_text.delta")
    return "".join(d["choices"][0]["delta"].get("content") or "" for _, d in evs
                   if isinstance(d, dict) and d["choices"])


def tool_of(api: str, evs: list) -> tuple[str, str, str]:
    """(call id, name, arguments JSON) of the streamed tool call."""
    if api == "anthropic":
        start = next(d["content_block"] for n, d in evs if n == "content_block_start"
                     and d["content_block"]["type"] == "tool_use")
        args = "".join(d["delta"]["partial_json"] for n, d in evs if n == "content_block_delta")
        assert evs[-2][1]["delta"]["stop_reason"] == "tool_use"
        return start["id"], start["name"], args
    if api == "responses":
        item = next(d["item"] for n, d in evs if n == "response.output_item.added")
        assert item["type"] == "function_call"
        args = "".join(d["delta"] for n, d in evs if n == "response.function_call_arguments.delta")
        done = next(d for n, d in evs if n == "response.function_call_arguments.done")
        assert done["arguments"] == args
        assert [n for n, _ in evs][-2:] == ["response.output_item.done", "response.completed"]
        return item["call_id"], item["name"], args
    chunks = [d for _, d in evs if isinstance(d, dict) and d["choices"]]
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in chunks if "tool_calls" in c["choices"][0]["delta"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    return calls[0]["id"], calls[0]["function"]["name"], "".join(c["function"]["arguments"] for c in calls)


def followup(api: str, users: list[str], call_id: str, name: str, args: str, result: str) -> dict:
    if api == "anthropic":
        extra = [{"role": "assistant", "content": [{"type": "tool_use", "id": call_id, "name": name,
                                                     "input": json.loads(args)}]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call_id, "content": result}]}]
    elif api == "responses":
        extra = [{"type": "function_call", "call_id": call_id, "name": name, "arguments": args},
                 {"type": "function_call_output", "call_id": call_id, "output": result}]
    else:
        extra = [{"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}]},
                 {"role": "tool", "tool_call_id": call_id, "content": result}]
    return body(api, users, extra=extra)


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


APIS = ["anthropic", "responses", "chat"]


@pytest.mark.parametrize("api", APIS)
def test_reply_rule_with_substring_regex_and_budget(fx, api) -> None:
    fx.add_rules(reply("two times", match="ping", times=2), reply("by regex", match=r"^pon+g$", regex=True))
    for _ in range(2):
        assert text_of(api, stream(fx, api, body(api, ["a ping b"]))[2]) == "two times"
    # budget spent: the default reply comes back
    assert text_of(api, stream(fx, api, body(api, ["a ping b"]))[2]) == expected_default_reply(["a ping b"])
    assert text_of(api, stream(fx, api, body(api, ["pooong"]))[2]) == expected_default_reply(["pooong"])
    assert text_of(api, stream(fx, api, body(api, ["ponnng"]))[2]) == "by regex"
    first, second = fx.rules()
    assert [r.rule for r in fx.requests()] == [first.id, first.id, None, None, second.id]
    assert fx.rules()[0].times == 0


def test_rule_matches_only_the_last_user_text_and_its_api(fx) -> None:
    fx.add_rules(reply("chat only", api="chat"), reply("last", match="second"))
    assert text_of("chat", stream(fx, "chat", body("chat", ["first"]))[2]) == "chat only"
    assert text_of("anthropic", stream(fx, "anthropic", body("anthropic", ["second", "first"]))[2]) == \
        expected_default_reply(["second", "first"])
    assert text_of("anthropic", stream(fx, "anthropic", body("anthropic", ["first", "second"]))[2]) == "last"


@pytest.mark.parametrize("api", APIS)
def test_recall_answers_from_the_conversation_received(fx, api) -> None:
    fx.add_rules(recall(0, prefix="you said: ", match="what did I say"), recall(-2, match="before"),
                 recall(9, match="nothing"))
    users = ["the first message\n\nwith paragraphs", "second", "what did I say first?"]
    assert text_of(api, stream(fx, api, body(api, users))[2]) == "you said: the first message\n\nwith paragraphs"
    assert text_of(api, stream(fx, api, body(api, ["x", "y", "before"]))[2]) == "y"
    assert text_of(api, stream(fx, api, body(api, ["nothing"]))[2]) == "(no such user message)"


@pytest.mark.parametrize("api", APIS)
def test_shell_tool_call_then_scripted_reply_on_the_result(fx, api) -> None:
    fx.add_rule(shell_call("echo hi", match="run it", then_reply="ran it"))
    _, _, evs = stream(fx, api, body(api, ["please run it"]))
    call_id, name, args = tool_of(api, evs)
    expected_name = {"anthropic": "Bash", "responses": "exec_command", "chat": "bash"}[api]
    assert name == expected_name
    expected_args = {"anthropic": {"command": "echo hi"}, "responses": {"cmd": "echo hi"},
                     "chat": {"command": "echo hi", "description": "fixture command"}}[api]
    assert json.loads(args) == expected_args
    rec = fx.last()
    assert rec.action == "tool_call" and rec.tool_call == {"call_id": call_id, "name": name, "arguments": args}
    # The follow-up carries the result: the same user text must not trigger the tool again.
    _, _, evs = stream(fx, api, followup(api, ["please run it"], call_id, name, args, "hi\n"))
    assert text_of(api, evs) == "ran it"
    assert fx.last().action == "tool_followup"


@pytest.mark.parametrize("api", APIS)
def test_named_tool_call_picks_the_request_tool_case_insensitively(fx, api) -> None:
    fx.add_rule(tool_call("BASH" if api != "responses" else "Exec_Command", {"command": "ls"}, match="go"))
    _, name, args = tool_of(api, stream(fx, api, body(api, ["go"]))[2])
    assert name == {"anthropic": "Bash", "responses": "exec_command", "chat": "bash"}[api]
    assert json.loads(args) == {"command": "ls"}


def test_tool_call_with_a_tool_the_request_lacks_uses_the_given_name(fx) -> None:
    fx.add_rule(tool_call("Agent", '{"prompt": "x"}', match="go"))
    _, name, args = tool_of("anthropic", stream(fx, "anthropic", body("anthropic", ["go"]))[2])
    assert (name, args) == ("Agent", '{"prompt": "x"}')


@pytest.mark.parametrize("api", APIS)
@pytest.mark.parametrize("status", [429, 500, 503, 529])
def test_transient_failures_with_vendor_bodies_and_retry_headers(fx, api, status) -> None:
    fx.add_rule(fail(status, times=1, retry_after=1, retry_after_ms=50))
    code, headers, (err,) = stream(fx, api, body(api, ["hi"]))
    assert code == status
    assert headers["retry-after"] == "1" and headers["retry-after-ms"] == "50"
    if api == "anthropic":
        assert err["type"] == "error"
        assert err["error"]["type"] == {429: "rate_limit_error", 500: "api_error", 503: "api_error",
                                        529: "overloaded_error"}[status]
    else:
        assert set(err["error"]) >= {"message", "type", "code"}
    # times=1: the retry succeeds
    assert text_of(api, stream(fx, api, body(api, ["hi"]))[2]) == expected_default_reply(["hi"])
    assert [r.status for r in fx.requests()] == [status, 200]


@pytest.mark.parametrize("api", APIS)
def test_terminal_reject_and_context_window_refusal(fx, api) -> None:
    fx.add_rules(reject(match="plain"), context_too_long(match="huge"))
    code, _, (err,) = stream(fx, api, body(api, ["plain"]))
    assert code == 400
    message = err["error"]["message"]
    assert message == TERMINAL_MESSAGE
    code, _, (err,) = stream(fx, api, body(api, ["huge"]))
    assert code == 400
    if api == "anthropic":
        assert err == {"type": "error", "error": {"type": "invalid_request_error",
                                                  "message": ANTHROPIC_CONTEXT_MESSAGE}}
        assert re.fullmatch(r"prompt is too long: \d+ tokens > \d+ maximum", ANTHROPIC_CONTEXT_MESSAGE)
    else:
        assert err["error"]["code"] == "context_length_exceeded"
        assert err["error"]["type"] == "invalid_request_error"
        assert "maximum context length is 131072 tokens" in err["error"]["message"]
    # pi must not take a terminal error for a transient one
    for text in (TERMINAL_MESSAGE, ANTHROPIC_CONTEXT_MESSAGE, OPENAI_CONTEXT_MESSAGE):
        assert not PI_RETRYABLE.search(text), text
        assert not PI_RETRYABLE.search("400 " + text)


@pytest.mark.parametrize("api", APIS)
def test_cut_stream_has_no_final_event(fx, api) -> None:
    fx.add_rule(cut(after_deltas=2, text="abcdefghijkl"))
    status, _, evs = stream(fx, api, body(api, ["hi"]))
    assert status == 200
    assert text_of(api, evs) == "abcdef"
    names = [n for n, _ in evs]
    final = {"anthropic": "message_stop", "responses": "response.completed", "chat": None}[api]
    if final:
        assert final not in names
    else:
        assert evs[-1] != (None, "[DONE]")
        assert all(not d["choices"] or d["choices"][0]["finish_reason"] is None for _, d in evs)
    assert fx.last().action == "cut" and fx.last().reply_text == "abcdef"


def test_cut_with_abort_drops_the_connection(fx) -> None:
    fx.add_rule(cut(after_deltas=1, abort=True, times=1))
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.post(fx.base_url + PATHS["chat"], json=body("chat", ["hi"]), timeout=5).read()
    # the server is still fine afterwards
    assert stream(fx, "chat", body("chat", ["hi"]))[0] == 200


def test_stall_sends_the_first_event_then_waits(fx) -> None:
    fx.add_rule(stall(0.6, times=1))
    with socket.create_connection((fx.host, fx.port), timeout=5) as s:
        payload = json.dumps(body("anthropic", ["hi"])).encode()
        s.sendall(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        t0 = time.monotonic()
        first = s.recv(65536)
        assert b"200" in first.split(b"\r\n")[0]
        data = first
        while b"message_start" not in data:
            data += s.recv(65536)
        t_first = time.monotonic() - t0
        while b"message_stop" not in data:
            data += s.recv(65536)
        t_all = time.monotonic() - t0
    assert t_first < 0.4 and t_all > 0.55


def test_stall_is_cut_short_when_the_fixture_closes() -> None:
    fx = LoopbackFixture.start()
    fx.add_rule(stall(30))
    done = threading.Event()

    def run() -> None:
        try:
            httpx.post(fx.base_url + PATHS["chat"], json=body("chat", ["hi"]), timeout=10).read()
        except httpx.HTTPError:
            pass
        done.set()

    threading.Thread(target=run, daemon=True).start()
    fx.wait_for(lambda rs: len(rs) == 1)
    t0 = time.monotonic()
    fx.close()
    assert done.wait(5) and time.monotonic() - t0 < 5


def test_side_requests_get_deterministic_replies_and_skip_rules(fx) -> None:
    fx.add_rule(reply("conversation rule", match="hello"))
    title = {"model": "m", "stream": True, "messages": [
        {"role": "system", "content": "You are a title generator. You output ONLY a thread title."},
        {"role": "user", "content": "Generate a title for this conversation:\n"},
        {"role": "user", "content": "hello"}]}
    assert text_of("chat", stream(fx, "chat", title)[2]) == TITLE_REPLY
    summary = {"model": "m", "stream": True, "messages": [
        {"role": "system", "content": "You are a context summarization assistant. Summarize."},
        {"role": "user", "content": "hello"}]}
    assert text_of("chat", stream(fx, "chat", summary)[2]).startswith("Fixture summary")
    assert [r.kind for r in fx.requests()] == ["title", "summary"]
    # a rule can opt in to side requests
    fx.add_rule(reply("custom title", kinds=["title"]))
    assert text_of("chat", stream(fx, "chat", title)[2]) == "custom title"


def test_rules_round_trip_as_json() -> None:
    rules = [reply("a", match="x", times=2), recall(1), tool_call(["bash", "exec_command"], shell="ls"),
             fail(503, retry_after_ms=50), reject(context_window=True), cut(3, abort=True), stall(1.5)]
    again = [Rule.model_validate_json(r.model_dump_json()) for r in rules]
    assert again == rules


def test_release_stalls_ends_a_stall_in_progress_and_only_that_one(fx) -> None:
    fx.add_rule(stall(600, match="held"))
    results: list[str] = []

    def run() -> None:
        results.append(text_of("chat", stream(fx, "chat", body("chat", ["held"]))[2]))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    fx.wait_stalled(1)
    fx.release_stalls()
    t.join(30)
    assert not t.is_alive() and results == [expected_default_reply(["held"])]
    # a stall that starts after the release is held again (the release is not sticky)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    fx.wait_stalled(1)
    t.join(0.5)
    assert t.is_alive()
    fx.release_stalls()
    t.join(30)
    assert not t.is_alive() and len(results) == 2
