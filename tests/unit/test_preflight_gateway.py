"""Every verdict of the preflight against a respx-mocked gateway (no network)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import httpx
import pytest

from deploy.preflight import check_model_context as cmd
from deploy.preflight.cases import build_case
from deploy.preflight.gateway import GatewayConfig, call, make_client
from deploy.preflight.verdict import CaseResult, judge

BASE = "https://gw.test"
ANTHROPIC_URL = f"{BASE}/v1/messages"
OPENAI_URL = f"{BASE}/v1/chat/completions"


# --- fake gateway streams -------------------------------------------------------------

def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def anthropic_sse(text: str, *, thinking: str | None = "Looking at the history.", stop: str = "end_turn",
                  final: bool = True, error: dict | None = None, msg_id: str = "msg_01") -> bytes:
    out = [_event("message_start", {"type": "message_start", "message": {"id": msg_id, "role": "assistant"}}),
           _event("ping", {"type": "ping"})]
    if error:
        return "".join(out + [_event("error", {"type": "error", "error": error})]).encode()
    idx = 0
    if thinking is not None:
        out += [_event("content_block_start", {"type": "content_block_start", "index": 0,
                                               "content_block": {"type": "thinking", "thinking": ""}}),
                _event("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "thinking_delta", "thinking": thinking}}),
                _event("content_block_stop", {"type": "content_block_stop", "index": 0})]
        idx = 1
    out.append(_event("content_block_start", {"type": "content_block_start", "index": idx,
                                              "content_block": {"type": "text", "text": ""}}))
    half = len(text) // 2
    for part in (text[:half], text[half:]):
        out.append(_event("content_block_delta", {"type": "content_block_delta", "index": idx,
                                                  "delta": {"type": "text_delta", "text": part}}))
    out += [_event("content_block_stop", {"type": "content_block_stop", "index": idx}),
            _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop}})]
    if final:
        out.append(_event("message_stop", {"type": "message_stop"}))
    return "".join(out).encode()


def openai_sse(text: str, *, reasoning: str | None = "Looking at the history.", finish: str | None = "stop",
               done: bool = True, error: dict | None = None) -> bytes:
    def chunk(delta: dict, finish_reason: str | None = None) -> str:
        body = {"id": "chatcmpl-7", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    out = [chunk({"role": "assistant", "content": ""})]
    if error:
        return "".join(out + [f"data: {json.dumps({'error': error})}\n\n"]).encode()
    if reasoning is not None:
        out.append(chunk({"reasoning_content": reasoning}))
    out.append(chunk({"content": text}))
    if finish:
        out.append(chunk({}, finish))
    if done:
        out.append("data: [DONE]\n\n")
    return "".join(out).encode()


def correct_answer(body: dict) -> str:
    """What a model that sees the whole history would say, per case."""
    messages = body["messages"]
    if messages[0]["role"] == "system":
        messages = messages[1:]
    history = " ".join(m["content"] for m in messages[:-1])
    if not history:
        return "This is the start of our conversation; you haven't asked me anything yet."
    if "db-blue" in history:
        return "db-green.internal"
    if "parse_cfg" in history:
        return "Rename parse_cfg to load_config in src/settings.py and update the call sites."
    if "PostgreSQL" in history:
        return "Which port PostgreSQL listens on by default (5432)."
    return 'You just said "hi"; you haven\'t asked me to do anything yet.'


def sse_response(content: bytes, **headers: str) -> httpx.Response:
    return httpx.Response(200, content=content, headers={"content-type": "text/event-stream", **headers})


def run_case(name: str, response: httpx.Response | Callable, respx_mock, *, api: str = "anthropic",
             lang: str = "en") -> CaseResult:
    url = ANTHROPIC_URL if api == "anthropic" else OPENAI_URL
    route = respx_mock.post(url)
    route.mock(side_effect=response) if callable(response) else route.mock(return_value=response)
    cfg = GatewayConfig(base_url=BASE, api=api)
    case = build_case(name, 1, lang)
    with make_client(cfg, None) as client:
        return judge(case, call(client, cfg, case, "k-test"), cfg.api)


# --- verdicts -----------------------------------------------------------------------

def test_pass_keeps_answer_request_id_and_thinking(respx_mock) -> None:
    r = run_case("task", sse_response(anthropic_sse("Rename parse_cfg to load_config."), **{"request-id": "req_42"}),
                 respx_mock)
    assert r.recall_passed and r.thinking_observed and r.failures == []
    assert r.request_id == "req_42" and "load_config" in r.answer and r.thinking_chars > 0


def test_request_id_falls_back_to_message_id(respx_mock) -> None:
    r = run_case("fact_update", sse_response(anthropic_sse("db-green.internal", msg_id="msg_abc")), respx_mock)
    assert r.recall_passed and r.request_id == "msg_abc"


def test_x_request_id_header_is_used(respx_mock) -> None:
    r = run_case("fact_update", sse_response(openai_sse("db-green.internal"), **{"x-request-id": "xr-1"}),
                 respx_mock, api="openai")
    assert r.recall_passed and r.thinking_observed and r.request_id == "xr-1"


def test_non_200_fails(respx_mock) -> None:
    resp = httpx.Response(529, json={"type": "error", "error": {"type": "overloaded_error"}},
                          headers={"request-id": "req_busy"})
    r = run_case("task", resp, respx_mock)
    assert not r.recall_passed and r.failures[0].startswith("HTTP 529")
    assert r.request_id == "req_busy" and r.missing_facts == []  # no content checks on a 529


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_stream_error_fails(respx_mock, api: str) -> None:
    err = {"type": "overloaded_error", "message": "Overloaded"}
    body = anthropic_sse("", error=err) if api == "anthropic" else openai_sse("", error=err)
    r = run_case("task", sse_response(body), respx_mock, api=api)
    assert not r.recall_passed
    assert r.failures == ["stream error: overloaded_error: Overloaded"]


@pytest.mark.parametrize(("api", "body", "reason"), [
    ("anthropic", anthropic_sse("db-green.internal", final=False), "without message_stop"),
    ("anthropic", anthropic_sse("db-green.internal", stop="max_tokens"), "stop reason max_tokens"),
    ("openai", openai_sse("db-green.internal", finish=None, done=False), "without [DONE] or a finish_reason"),
    ("openai", openai_sse("db-green.internal", finish="length"), "stop reason length"),
])
def test_truncation_fails_even_with_the_right_fact(respx_mock, api: str, body: bytes, reason: str) -> None:
    r = run_case("fact_update", sse_response(body), respx_mock, api=api)
    assert not r.recall_passed and r.answer == "db-green.internal"
    assert any(reason in f for f in r.failures), r.failures


def test_stream_cut_by_the_connection_is_truncation(respx_mock) -> None:
    class Cut(httpx.SyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield anthropic_sse("db-green.internal", final=False)[:200]
            raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    r = run_case("fact_update", httpx.Response(200, stream=Cut()), respx_mock)
    assert not r.recall_passed
    assert "truncated: stream ended without message_stop (RemoteProtocolError" in r.failures[0]


def test_missing_fact_fails(respx_mock) -> None:
    r = run_case("fact_update", sse_response(anthropic_sse("db-blue.internal")), respx_mock)
    assert not r.recall_passed
    assert r.failures == ["missing fact: gives the updated host db-green.internal"]


def test_missing_history_claim_english_fails_and_names_phrase(respx_mock) -> None:
    r = run_case("greeting", sse_response(anthropic_sse("I don't have any previous messages from you.")),
                 respx_mock)
    assert not r.recall_passed
    assert [c.phrase for c in r.history_claims] == ["I don't have any previous messages"]
    assert any('missing-history claim: "I don\'t have any previous messages"' in f for f in r.failures)


def test_missing_history_claim_chinese_fails_and_names_phrase(respx_mock) -> None:
    reply = "我没有之前的对话记录，这是我们对话的开始。"
    r = run_case("greeting", sse_response(anthropic_sse(reply)), respx_mock, lang="zh")
    assert not r.recall_passed
    claims = [f for f in r.failures if f.startswith("missing-history claim")]
    assert len(claims) == 2 and "我没有之前的对话记录" in claims[0] and "这是我们对话的开始" in claims[1]


def test_nothing_asked_claim_fails_the_task_case(respx_mock) -> None:
    r = run_case("task", sse_response(openai_sse("你还没有让我做任何事。")), respx_mock, api="openai", lang="zh")
    assert not r.recall_passed
    assert any('"你还没有让我做任何事"' in f for f in r.failures)


def test_greeting_tolerates_nothing_asked_only_beside_the_greeting(respx_mock) -> None:
    ok = run_case("greeting", sse_response(anthropic_sse("你刚才只是说了“hi”，还没有让我做任何事。")),
                  respx_mock, lang="zh")
    assert ok.recall_passed and ok.history_claims[0].tolerated
    respx_mock.reset()
    bare = run_case("greeting", sse_response(anthropic_sse("你还没有让我做任何事。")), respx_mock, lang="zh")
    assert not bare.recall_passed and not bare.history_claims[0].tolerated


def test_no_history_case_accepts_a_no_history_claim(respx_mock) -> None:
    for reply in ("This is the start of our conversation; you haven't asked me anything yet.",
                  "我没有之前的对话记录，这是我们对话的开始。"):
        respx_mock.reset()
        r = run_case("no_history", sse_response(anthropic_sse(reply)), respx_mock)
        assert r.recall_passed, r.failures
        assert r.history_claims and all(c.tolerated for c in r.history_claims)


def test_thinking_absent_but_recall_fine(respx_mock) -> None:
    r = run_case("task", sse_response(anthropic_sse("Rename parse_cfg to load_config.", thinking=None)), respx_mock)
    assert r.recall_passed and not r.thinking_observed and r.thinking_chars == 0
    respx_mock.reset()
    r = run_case("task", sse_response(openai_sse("load_config", reasoning=None)), respx_mock, api="openai")
    assert r.recall_passed and not r.thinking_observed


def test_quoted_claim_false_positive_is_rejected_and_named(respx_mock) -> None:
    # Documented behaviour (detector docstring, README): the right answer, but it quotes
    # the bad claim to correct it; the literal detector rejects it and names the phrase.
    reply = 'I wouldn\'t say "I don\'t have any previous messages": you said "hi".'
    r = run_case("greeting", sse_response(anthropic_sse(reply)), respx_mock)
    assert r.missing_facts == [] and not r.recall_passed
    assert r.failures == ['missing-history claim: "I don\'t have any previous messages" '
                          "(en: I don't have/see previous messages)"]


def test_empty_answer_fails(respx_mock) -> None:
    r = run_case("no_history", sse_response(anthropic_sse("")), respx_mock)
    assert not r.recall_passed and r.failures == ["empty answer"]


# --- request shapes -----------------------------------------------------------------

def test_anthropic_request_shape(respx_mock) -> None:
    route = respx_mock.post(ANTHROPIC_URL).mock(return_value=sse_response(anthropic_sse("db-green.internal")))
    cfg = GatewayConfig(base_url=BASE + "/")
    with make_client(cfg, None) as client:
        call(client, cfg, build_case("fact_update", 1, "en"), "k-test")
    req = route.calls.last.request
    body = json.loads(req.content)
    assert req.headers["x-api-key"] == "k-test" and req.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in req.headers
    assert body["model"] == "deepseek-v4-flash" and body["stream"] is True
    assert body["thinking"] == {"type": "adaptive"} and body["system"]
    assert [m["role"] for m in body["messages"]] == ["user", "assistant", "user", "assistant", "user"]


def test_anthropic_budget_thinking_keeps_max_tokens_above_budget() -> None:
    from deploy.preflight.gateway import build_body

    body = build_body(GatewayConfig(base_url=BASE, thinking="budget", thinking_budget=20000, max_tokens=1000),
                      build_case("task", 1, "en"))
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 20000} and body["max_tokens"] > 20000


def test_openai_request_shape(respx_mock) -> None:
    route = respx_mock.post(OPENAI_URL).mock(return_value=sse_response(openai_sse("db-green.internal")))
    cfg = GatewayConfig(base_url=BASE, api="openai", model="m-x")
    with make_client(cfg, None) as client:
        call(client, cfg, build_case("fact_update", 1, "en"), "k-test")
    req = route.calls.last.request
    body = json.loads(req.content)
    assert req.headers["authorization"] == "Bearer k-test" and "x-api-key" not in req.headers
    assert body["reasoning_effort"] == "high" and body["stream"] is True and body["model"] == "m-x"
    assert body["messages"][0]["role"] == "system"


# --- the command ---------------------------------------------------------------------

@pytest.fixture
def key_file(tmp_path, monkeypatch):
    path = tmp_path / "key"
    path.write_text("k-test\n")
    monkeypatch.setenv(cmd.KEY_FILE_ENV, str(path))
    monkeypatch.delenv(cmd.PROXY_ENV, raising=False)
    return path


def _answering(api: str) -> Callable[[httpx.Request], httpx.Response]:
    def answer(request: httpx.Request) -> httpx.Response:
        text = correct_answer(json.loads(request.content))
        return sse_response(anthropic_sse(text) if api == "anthropic" else openai_sse(text))
    return answer


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_command_fifteen_calls_pass_with_json(respx_mock, key_file, capsys, api: str) -> None:
    route = respx_mock.post(ANTHROPIC_URL if api == "anthropic" else OPENAI_URL).mock(side_effect=_answering(api))
    assert cmd.main([BASE, "--repetitions", "3", "--api", api, "--json"]) == cmd.EXIT_OK
    doc = json.loads(capsys.readouterr().out)
    assert route.call_count == 15 and len(doc["results"]) == 15
    assert doc["summary"] == {"cases": 15, "failed": 0, "recall_passed": True,
                              "thinking_observed": True, "thinking_observed_cases": 15}
    assert doc["model"] == "deepseek-v4-flash" and doc["api"] == api


def test_command_table_and_failure_exit_code(respx_mock, key_file, capsys) -> None:
    def forgetful(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        text = correct_answer(body)
        if "db-blue" in json.dumps(body):
            text = "I don't have any previous messages."
        return sse_response(anthropic_sse(text, thinking=None), **{"request-id": "req_t"})

    respx_mock.post(ANTHROPIC_URL).mock(side_effect=forgetful)
    assert cmd.main([BASE, "--repetitions", "1"]) == cmd.EXIT_FAILED
    out = capsys.readouterr().out
    header = out.splitlines()[0].split()
    assert header[:5] == ["case", "rep", "lang", "recall_passed", "thinking_observed"]
    assert "fact_update" in out and "NO" in out and "req_t" in out
    assert "-> missing-history claim: \"I don't have any previous messages\"" in out
    assert "recall_passed: NO (4/5 cases)   thinking_observed: no (0/5 cases)" in out


def test_command_case_filter(respx_mock, key_file, capsys) -> None:
    route = respx_mock.post(ANTHROPIC_URL).mock(side_effect=_answering("anthropic"))
    assert cmd.main([BASE, "--repetitions", "2", "--case", "greeting", "--json"]) == cmd.EXIT_OK
    assert route.call_count == 2
    assert {r["case"] for r in json.loads(capsys.readouterr().out)["results"]} == {"greeting"}


def test_command_without_key_file_is_a_usage_error(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.delenv(cmd.KEY_FILE_ENV, raising=False)
    assert cmd.main([BASE]) == cmd.EXIT_USAGE
    assert cmd.KEY_FILE_ENV in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    monkeypatch.setenv(cmd.KEY_FILE_ENV, str(tmp_path / "empty"))
    assert cmd.main([BASE]) == cmd.EXIT_USAGE
    assert "is empty" in capsys.readouterr().err


def test_proxy_comes_only_from_the_environment_variable(monkeypatch) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://ambient.invalid:1")
    cfg = GatewayConfig(base_url=BASE)
    with make_client(cfg, None) as client:
        assert not client._mounts  # the ambient proxy is ignored (trust_env=False)
    with make_client(cfg, "http://proxy.test:3128") as client:
        assert client._mounts
