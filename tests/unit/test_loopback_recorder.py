"""Recorder: what is kept of each request, and what never is (credentials)."""

from __future__ import annotations

import json

import httpx

from deploy.loopback import LoopbackFixture, load_jsonl, reply, safe_headers

SECRET = "sk-ant-SECRET-canary-7f3a"


def test_safe_headers_drops_credentials() -> None:
    kept = safe_headers([("Authorization", "Bearer x"), ("X-Api-Key", "k"), ("Cookie", "c"),
                         ("Proxy-Authorization", "p"), ("x-goog-api-key", "g"), ("X-Session-Token", "t"),
                         ("User-Agent", "claude-cli"), ("x-stainless-retry-count", "0"), ("Accept", "a"),
                         ("accept", "b")])
    assert kept == {"user-agent": "claude-cli", "x-stainless-retry-count": "0", "accept": "a, b"}


def test_records_everything_but_secrets(tmp_path) -> None:
    path = tmp_path / "sub" / "rec.jsonl"
    with LoopbackFixture.start(record_path=str(path)) as fx:
        fx.add_rule(reply("scripted", match="hello", id="greet"))
        headers = {"x-api-key": SECRET, "authorization": f"Bearer {SECRET}", "cookie": f"s={SECRET}",
                   "proxy-authorization": SECRET, "anthropic-version": "2023-06-01", "x-claude-code-session-id": "abc"}
        body = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hello"}]}
        httpx.post(fx.base_url + "/v1/messages?beta=true", json=body, headers=headers).read()
        httpx.post(fx.base_url + "/v1/messages", content=b"garbage", headers=headers).read()
        httpx.head(fx.base_url + "/api/hello", headers=headers)
        recs = fx.requests()
    assert [(r.seq, r.method, r.api, r.kind, r.status) for r in recs] == [
        (1, "POST", "anthropic", "conversation", 200), (2, "POST", "anthropic", "other", 400),
        (3, "HEAD", "head", "probe", 200)]
    ok = recs[0]
    assert ok.path == "/v1/messages" and ok.query == "beta=true" and ok.body == body
    assert ok.reply_text == "scripted" and ok.rule == "greet" and ok.action == "reply"
    assert ok.headers["anthropic-version"] == "2023-06-01" and ok.headers["x-claude-code-session-id"] == "abc"
    assert ok.time > 0
    assert recs[1].raw == "garbage" and recs[1].body is None and recs[1].error
    # in memory and on disk: no secret anywhere
    assert SECRET not in json.dumps([r.model_dump(mode="json") for r in recs])
    text = path.read_text()
    assert SECRET not in text
    on_disk = load_jsonl(path)
    assert sorted(r.seq for r in on_disk) == [1, 2, 3]
    assert {r.seq: r.reply_text for r in on_disk}[1] == "scripted"


def test_reset_clears_records_and_rules() -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rule(reply("x"))
        httpx.head(fx.base_url + "/")
        fx.reset(rules=False)
        assert fx.requests() == [] and len(fx.rules()) == 1
        fx.reset()
        assert fx.rules() == []
        httpx.head(fx.base_url + "/")
        assert fx.requests()[0].seq == 2  # sequence numbers keep counting
