"""The proxy's small parts: allow-list and target parsing, credential stripping and the key
source, the reply reader, the configuration edge."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from deploy.loopback.behaviour import TextOut
from deploy.loopback.sse import FRAMES
from proxy.config import ProxyConfig
from proxy.exchange import response_headers, upstream_headers
from proxy.keys import KeySource, KeyUnavailable, is_credential_header, placeholder_key
from proxy.reply import ReplyReader
from proxy.routes import ROUTES, match, member_base_url, parse_target

# ---------------------------------------------------------------- allow-list


def test_the_allow_list_is_exactly_the_pinned_clis_model_routes() -> None:
    assert sorted((r.method, r.path) for r in ROUTES) == [
        ("GET", "/v1/models"), ("HEAD", "/api/hello"), ("POST", "/v1/chat/completions"),
        ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses")]
    assert all(r.source for r in ROUTES)


@pytest.mark.parametrize("method,path", [
    ("GET", "/_fixture/requests"), ("POST", "/_fixture/rules"), ("POST", "/_fixture/reset"),
    ("GET", "/v1/messages"), ("POST", "/v1/../_fixture/rules"), ("POST", "/v1/messages/"),
    ("HEAD", "/"), ("POST", "/messages"), ("GET", "/metrics"), ("POST", "/v1/jobs"), ("DELETE", "/v1/responses"),
    ("POST", "/v1/%6Dessages"), ("CONNECT", "/v1/messages"),
])
def test_anything_else_is_not_a_route(method: str, path: str) -> None:
    assert match(method, path) is None


def test_parse_target_takes_the_member_from_the_prefix() -> None:
    t = parse_target("/m/member-1.a_b/v1/messages?beta=true")
    assert (t.member_key, t.path, t.query) == ("member-1.a_b", "/v1/messages", "beta=true")
    assert parse_target("/v1/messages").member_key is None
    assert parse_target("/m/../v1/messages").member_key is None
    assert parse_target("/m//v1/messages").member_key is None
    assert parse_target("/m/a%2Fb/v1/messages").member_key is None
    t = parse_target("/m/x")
    assert (t.member_key, t.path) == ("x", "")


def test_member_base_url() -> None:
    assert member_base_url(18080, "m1") == "http://127.0.0.1:18080/m/m1"
    with pytest.raises(ValueError, match="member_key"):
        member_base_url(18080, "a/b")


# ---------------------------------------------------------------- credentials


def test_every_credential_header_is_dropped_and_the_key_set_in_the_routes_shape() -> None:
    headers = [(b"host", b"127.0.0.1:18080"), (b"x-api-key", b"placeholder"), (b"authorization", b"Bearer p"),
               (b"api-key", b"p"), (b"x-goog-api-key", b"p"), (b"proxy-authorization", b"p"), (b"cookie", b"s=1"),
               (b"x-auth-token", b"p"), (b"x-my-secret", b"p"), (b"anthropic-version", b"2023-06-01"),
               (b"anthropic-beta", b"a,b"), (b"content-length", b"12"), (b"connection", b"keep-alive, x-hop"),
               (b"x-hop", b"1"), (b"transfer-encoding", b"chunked"), (b"accept-encoding", b"gzip, zstd"),
               (b"x-claude-code-session-id", b"s1"), (b"expect", b"100-continue")]
    out = upstream_headers(headers, match("POST", "/v1/messages"), "sk-real")  # type: ignore[arg-type]
    assert out == [("anthropic-version", "2023-06-01"), ("anthropic-beta", "a,b"),
                   ("x-claude-code-session-id", "s1"), ("content-length", "12"), ("x-api-key", "sk-real"),
                   ("accept-encoding", "identity")]
    out = upstream_headers([(b"authorization", b"Bearer placeholder")], match("POST", "/v1/responses"), "sk-real")  # type: ignore[arg-type]
    assert out == [("authorization", "Bearer sk-real"), ("accept-encoding", "identity")]
    # a route without a fixed family (models) follows the shape the CLI used for its placeholder
    models = match("GET", "/v1/models")
    assert upstream_headers([(b"x-api-key", b"p")], models, "k")[0] == ("x-api-key", "k")  # type: ignore[arg-type]
    assert upstream_headers([(b"authorization", b"Bearer p")], models, "k")[0] == ("authorization", "Bearer k")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", ["Authorization", "X-API-Key", "api-key", "X-Auth-Token", "x-session-token",
                                  "x-client-secret", "Cookie", "x-apikey", "proxy-authorization"])
def test_credential_header_names(name: str) -> None:
    assert is_credential_header(name)


@pytest.mark.parametrize("name", ["anthropic-version", "x-stainless-retry-count", "x-claude-code-session-id",
                                  "session-id", "thread-id", "x-codex-turn-metadata", "originator", "x-title",
                                  "http-referer", "content-type", "user-agent"])
def test_headers_the_clis_send_are_kept(name: str) -> None:
    assert not is_credential_header(name)


def test_the_key_is_redacted_from_response_headers() -> None:
    headers = [(b"www-authenticate", b"key sk-real-1234 is wrong"), (b"x-request-id", b"r1"),
               (b"connection", b"close"), (b"transfer-encoding", b"chunked"), (b"content-length", b"99")]
    assert response_headers(headers, "sk-real-1234", body_length=5) == [
        (b"www-authenticate", b"key [redacted] is wrong"), (b"x-request-id", b"r1"), (b"content-length", b"5")]


def test_placeholder_is_per_sandbox_and_not_the_key() -> None:
    assert placeholder_key("a") != placeholder_key("b")
    assert placeholder_key("a") == placeholder_key("a")
    assert placeholder_key("a").startswith("ca-placeholder-")


@pytest.mark.anyio
async def test_key_source_host_file_per_user_dir_and_rotation(tmp_path: Path) -> None:
    host = tmp_path / "host.key"
    host.write_text("sk-host-key-0001\n")
    users = tmp_path / "users"
    users.mkdir()
    (users / "alice").write_text("sk-alice-key-01")
    src = KeySource(key_file=host, key_dir=users, ttl_s=0.0)
    assert await src.key_for("alice") == "sk-alice-key-01"
    assert await src.key_for("bob") == "sk-host-key-0001"  # falls back to the host key
    (users / "alice").write_text("sk-alice-key-02")
    assert await src.key_for("alice") == "sk-alice-key-02"  # re-read after the ttl
    only_dir = KeySource(key_dir=users)
    with pytest.raises(KeyUnavailable, match="CLOUD_AGENT_GATEWAY_KEY_DIR") as err:
        await only_dir.key_for("bob")
    assert "sk-" not in str(err.value)
    with pytest.raises(KeyUnavailable, match="not a valid key file name"):
        await only_dir.key_for("../host.key")
    (users / "carol").write_text("has a\nnewline inside")
    with pytest.raises(KeyUnavailable, match="holds no valid key"):
        await only_dir.key_for("carol")
    with pytest.raises(ValueError, match="CLOUD_AGENT_GATEWAY_KEY_FILE"):
        KeySource()


# ---------------------------------------------------------------- config


def test_config_from_env_names_the_bad_field(tmp_path: Path) -> None:
    cfg = ProxyConfig.from_env({"CLOUD_AGENT_GATEWAY_URL": "http://127.0.0.1:9/", "CLOUD_AGENT_GATEWAY_KEY_FILE":
                                str(tmp_path / "k"), "CLOUD_AGENT_WIRE_CAPTURE": "1"})
    assert (cfg.upstream_url, cfg.key_file, cfg.capture) == ("http://127.0.0.1:9", tmp_path / "k", True)
    assert ProxyConfig.from_env({"CLOUD_AGENT_GATEWAY_URL": "https://gw.example/api", "CLOUD_AGENT_GATEWAY_KEY_DIR":
                                 "/keys"}).capture is False
    with pytest.raises(ValidationError, match="upstream_url"):
        ProxyConfig.from_env({"CLOUD_AGENT_GATEWAY_KEY_FILE": "/k"})
    with pytest.raises(ValidationError, match="key_file"):
        ProxyConfig.from_env({"CLOUD_AGENT_GATEWAY_URL": "http://127.0.0.1:9"})


# ---------------------------------------------------------------- reply reader


def _frames(api: str, text: str) -> list[bytes]:
    return [frame for frame, _ in FRAMES[api]([TextOut(text)], "m", 1)]


@pytest.mark.parametrize("api", ["anthropic", "responses", "chat"])
def test_reply_reader_reads_the_fixtures_streams_chunk_by_chunk(api: str) -> None:
    data = b"".join(_frames(api, "héllo wörld"))
    reader = ReplyReader(api, "text/event-stream; charset=utf-8")
    for i in range(0, len(data), 7):  # chunk boundaries anywhere, even inside a UTF-8 sequence
        reader.feed(data[i:i + 7])
    result = reader.result()
    assert result is not None and [(m.role, m.text) for m in result] == [("assistant", "héllo wörld")]


def test_reply_reader_json_bodies_and_garbage() -> None:
    r = ReplyReader("anthropic", "application/json")
    r.feed(json.dumps({"content": [{"type": "text", "text": "a"}, {"type": "tool_use", "id": "t"}]}).encode())
    assert [(m.role, m.text) for m in r.result() or []] == [("assistant", "a")]
    r = ReplyReader("chat", "application/json")
    r.feed(b'{"choices": [{"message": {"role": "assistant", "content": "hi"}}]}')
    assert [(m.role, m.text) for m in r.result() or []] == [("assistant", "hi")]
    r = ReplyReader("responses", "text/event-stream")
    r.feed(b'data: {"type": "response.completed", not json\n\n')
    assert r.result() is None
    assert ReplyReader(None, "text/event-stream").result() is None


@settings(max_examples=200, deadline=None)
@given(chunks=st.lists(st.binary(max_size=64), max_size=8), api=st.sampled_from(["anthropic", "responses", "chat"]),
       sse=st.booleans())
def test_reply_reader_never_raises(chunks: list[bytes], api: str, sse: bool) -> None:
    r = ReplyReader(api, "text/event-stream" if sse else "application/json")
    for c in chunks:
        r.feed(b"data: " + c + b"\n")
    result = r.result()
    assert result is None or all(m.role == "assistant" for m in result)
