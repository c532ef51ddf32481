"""The fixture's HTTP surface: each API shape streamed, probes, malformed requests, control API."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest

from deploy.loopback import FixtureClient, LoopbackFixture, expected_default_reply, reply, stall
from deploy.loopback.sse import parse_sse

REPO = Path(__file__).resolve().parents[2]

ANTHROPIC = ("/v1/messages?beta=true", {"model": "m", "stream": True, "max_tokens": 10,
                                        "messages": [{"role": "user", "content": "hello there"}]})
RESPONSES = ("/v1/responses", {"model": "m", "stream": True, "input": [
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hello there"}]}]})
CHAT = ("/v1/chat/completions", {"model": "m", "stream": True,
                                 "messages": [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}]})
EXPECTED = expected_default_reply(["hello there"])


@pytest.fixture
def fx():
    with LoopbackFixture.start(port=0) as fixture:
        yield fixture


def events(fx: LoopbackFixture, path: str, body: dict) -> list[tuple[str | None, dict | str]]:
    with httpx.stream("POST", fx.base_url + path, json=body, timeout=10) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        text = resp.read().decode()
    return [(name, data if data == "[DONE]" else json.loads(data)) for name, data in parse_sse(text)]


def chat_text(evs: list) -> str:
    return "".join(d["choices"][0]["delta"].get("content") or "" for _, d in evs if isinstance(d, dict) and d["choices"])


def test_default_reply_is_a_pure_function() -> None:
    import hashlib

    assert expected_default_reply(["a", "b"]) == f"ok 2: {hashlib.sha256(b'b').hexdigest()[:10]}"
    assert expected_default_reply([]) == f"ok 0: {hashlib.sha256(b'').hexdigest()[:10]}"


def test_anthropic_stream(fx) -> None:
    evs = events(fx, *ANTHROPIC)
    names = [n for n, _ in evs]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert all(d["type"] == n for n, d in evs)
    deltas = [d["delta"]["text"] for n, d in evs if n == "content_block_delta"]
    assert len(deltas) > 1 and "".join(deltas) == EXPECTED
    assert evs[-2][1]["delta"]["stop_reason"] == "end_turn"
    assert evs[0][1]["message"]["usage"]["input_tokens"] < 100
    rec = fx.last()
    assert rec.api == "anthropic" and rec.query == "beta=true" and rec.reply_text == EXPECTED and rec.status == 200


def test_responses_stream_full_item_lifecycle(fx) -> None:
    evs = events(fx, *RESPONSES)
    names = [n for n, _ in evs]
    n_delta = names.count("response.output_text.delta")
    assert n_delta > 1
    assert names == (["response.created", "response.in_progress", "response.output_item.added",
                      "response.content_part.added"] + ["response.output_text.delta"] * n_delta
                     + ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                        "response.completed"])
    assert [d["sequence_number"] for _, d in evs] == list(range(len(evs)))
    assert all(d["type"] == n for n, d in evs)
    assert "".join(d["delta"] for n, d in evs if n == "response.output_text.delta") == EXPECTED
    added, done = evs[2][1]["item"], evs[-2][1]["item"]
    assert added["type"] == "message" and added["role"] == "assistant" and added["id"] == done["id"]
    assert done["content"] == [{"type": "output_text", "text": EXPECTED, "annotations": []}]
    completed = evs[-1][1]["response"]
    assert completed["status"] == "completed" and completed["usage"]["total_tokens"] < 100


def test_chat_stream(fx) -> None:
    evs = events(fx, *CHAT)
    assert evs[-1] == (None, "[DONE]")
    chunks = [d for _, d in evs[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == EXPECTED
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finish == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] < 100


def test_non_streaming_request_gets_a_json_body(fx) -> None:
    path, body = CHAT
    resp = httpx.post(fx.base_url + path, json={**body, "stream": False})
    assert resp.json()["choices"][0]["message"]["content"] == EXPECTED


def test_head_probe_on_any_path(fx) -> None:
    assert httpx.head(fx.base_url + "/api/hello").status_code == 200
    assert httpx.head(fx.base_url + "/").status_code == 200
    recs = fx.requests()
    assert [(r.api, r.kind, r.status) for r in recs] == [("head", "probe", 200)] * 2
    assert fx.conversation_requests() == []


@pytest.mark.parametrize(("path", "content", "method"), [
    ("/v1/messages", b"{not json", "POST"),
    ("/v1/messages", b'{"model": "m"}', "POST"),
    ("/v1/messages", b"", "GET"),
    ("/v1/responses", b'{"model": "m"}', "POST"),
    ("/v1/chat/completions", b"[1, 2]", "POST"),
    ("/v1/chat/completions", b"", "GET"),
])
def test_malformed_requests_get_the_vendor_400_and_are_recorded(fx, path, content, method) -> None:
    resp = httpx.request(method, fx.base_url + path, content=content)
    assert resp.status_code == 400
    body = resp.json()
    if path == "/v1/messages":
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["error"]["message"]
    else:
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
        assert "code" in body["error"]
    (rec,) = fx.requests()
    assert rec.status == 400 and rec.error and rec.method == method and rec.kind == "other"


def test_unknown_route_is_404_and_recorded(fx) -> None:
    resp = httpx.post(fx.base_url + "/v1/completions", json={})
    assert resp.status_code == 404 and "error" in resp.json()
    assert fx.requests()[0].api == "other"


def test_concurrent_requests(fx) -> None:
    # one stalled stream must not hold up the others (OpenCode sends title + conversation at once)
    fx.add_rule(stall(5, match="msg 0"))
    results: dict[int, str] = {}

    def one(i: int) -> None:
        body = {**CHAT[1], "messages": [{"role": "user", "content": f"msg {i}"}]}
        results[i] = chat_text(events(fx, CHAT[0], body))

    stalled = threading.Thread(target=one, args=(0,))
    stalled.start()
    fx.wait_for(lambda rs: len(rs) == 1, timeout=10)  # msg 0 is being served (and stalls)
    others = [threading.Thread(target=one, args=(i,)) for i in range(1, 8)]
    for t in others:
        t.start()
    for t in others:
        t.join(10)
    assert sorted(results) == list(range(1, 8)), "the other streams finished while msg 0 stalled"
    assert stalled.is_alive()
    stalled.join(15)
    assert results == {i: expected_default_reply([f"msg {i}"]) for i in range(8)}
    assert [r.seq for r in fx.requests()] == list(range(1, 9))


def test_control_api(fx) -> None:
    with FixtureClient(fx.base_url, token=fx.control_token) as client:
        ids = client.add_rules(reply("scripted", match="hello"))
        assert [r.id for r in client.rules()] == ids
        assert chat_text(events(fx, *CHAT)) == "scripted"
        recs = client.requests()
        assert len(recs) == 1 and recs[0].reply_text == "scripted" and recs[0].rule == ids[0]
        assert client.requests(since=recs[0].seq) == []
        assert client.requests(kind="title") == []
        client.reset()
        assert client.requests() == [] and client.rules() == []
    # control traffic is never recorded
    assert fx.requests() == []
    auth = {"authorization": f"Bearer {fx.control_token}"}
    bad = httpx.post(fx.base_url + "/_fixture/rules", json={"action": {"type": "nope"}}, headers=auth)
    assert bad.status_code == 422
    raw = httpx.post(fx.base_url + "/_fixture/rules", json=[{"match": "x", "action": {"type": "reply", "text": "y"}}],
                     headers=auth)
    assert raw.status_code == 200 and len(fx.rules()) == 1


@pytest.mark.parametrize("header", [None, "Bearer wrong-token", "Basic {token}", "{token}"])
def test_control_routes_need_the_fixture_token(fx, header) -> None:
    # SPEC 9.3: without its own token nobody reads the recorded requests nor scripts replies
    headers = {} if header is None else {"authorization": header.format(token=fx.control_token)}
    fx.add_rules(reply("kept", match="hello"))
    for method, path, body in (("GET", "/_fixture/requests", None), ("GET", "/_fixture/rules", None),
                               ("POST", "/_fixture/rules", [{"match": "x", "action": {"type": "reply", "text": "y"}}]),
                               ("POST", "/_fixture/reset", {})):
        resp = httpx.request(method, fx.base_url + path, json=body, headers=headers)
        assert (resp.status_code, resp.json()["error"]["message"]) == (
            401, "the fixture's control routes need its control token")
    assert [r.action.text for r in fx.rules()] == ["kept"]
    assert httpx.get(fx.base_url + "/_fixture/health").json() == {"ok": True}


def test_only_loopback_hosts() -> None:
    with pytest.raises(ValueError):
        LoopbackFixture.start(host="0.0.0.0")


@pytest.mark.anyio
async def test_usable_from_async_tests(anyio_backend) -> None:
    async with LoopbackFixture.start() as fx:
        async with httpx.AsyncClient() as client:
            resp = await client.post(fx.base_url + CHAT[0], json=CHAT[1])
            assert EXPECTED[:4] in resp.text
        assert len(fx.conversation_requests()) == 1


def test_module_entry_point(tmp_path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"rules": [{"match": "hello", "action": {"type": "reply", "text": "from script"}}]}))
    record = tmp_path / "rec.jsonl"
    token_file = tmp_path / "token"
    proc = subprocess.Popen([sys.executable, "-m", "deploy.loopback", "--port", "0", "--record", str(record),
                             "--script", str(script), "--token-file", str(token_file)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().strip()
        assert line.startswith("loopback listening on http://127.0.0.1:")
        url = line.rsplit(" ", 1)[1]
        resp = httpx.post(url + CHAT[0], json=CHAT[1], timeout=10)
        assert "from script"[:3] in resp.text
        assert oct(token_file.stat().st_mode & 0o777) == "0o600"
        assert httpx.get(url + "/_fixture/rules", timeout=10).status_code == 401
        with FixtureClient(url, token=token_file.read_text().strip()) as client:
            assert [r.action.text for r in client.rules()] == ["from script"]
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
    from deploy.loopback import load_jsonl

    (rec,) = load_jsonl(record)
    assert rec.reply_text == "from script" and rec.api == "chat"
