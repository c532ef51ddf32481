"""The gateway key and authentication headers never reach stdout, stderr or --json."""

from __future__ import annotations

import json

import httpx
import pytest

from deploy.preflight import check_model_context as cmd

BASE = "https://gw.test"
KEY = "sk-PREFLIGHT-CANARY-7f3a9c1e5b"
FORBIDDEN = (KEY, "PREFLIGHT-CANARY", "x-api-key", "authorization", "bearer")


def _sse(text: str) -> bytes:
    events = [
        {"type": "message_start", "message": {"id": "msg_s"}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": text}},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn"}},
        {"type": "message_stop"},
    ]
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def _echo_gateway(request: httpx.Request) -> httpx.Response:
    """A hostile gateway: answers every other call with an error that echoes the headers."""
    if "db-blue" in request.content.decode():
        echoed = "; ".join(f"{k}: {v}" for k, v in request.headers.items())
        return httpx.Response(401, text=f"bad credentials, you sent {echoed}")
    seen = request.headers.get("x-api-key") or request.headers.get("authorization", "")
    text = f"I saw key {seen.removeprefix('Bearer ')}"
    if request.url.path.endswith("/chat/completions"):
        chunk = {"id": "c1", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": "stop"}]}
        body = f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode()
    else:
        body = _sse(text)
    return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})


@pytest.fixture
def key_env(tmp_path, monkeypatch):
    path = tmp_path / "gateway-key"
    path.write_text(KEY + "\n")
    monkeypatch.setenv(cmd.KEY_FILE_ENV, str(path))
    monkeypatch.delenv(cmd.PROXY_ENV, raising=False)


@pytest.mark.parametrize("extra", [[], ["--json"], ["--answers", "--show-requests"],
                                   ["--json", "--show-requests", "--api", "openai"]])
def test_key_and_auth_headers_never_printed(respx_mock, key_env, capfd, extra: list[str]) -> None:
    anthropic = respx_mock.post(f"{BASE}/v1/messages").mock(side_effect=_echo_gateway)
    openai = respx_mock.post(f"{BASE}/v1/chat/completions").mock(side_effect=_echo_gateway)
    code = cmd.main([BASE, "--repetitions", "1", *extra])
    out, err = capfd.readouterr()
    assert code == cmd.EXIT_FAILED  # the echoing 401 fails its case
    # The key really was sent, as a header only ...
    sent = (anthropic.calls or openai.calls).last.request
    assert KEY in (sent.headers.get("x-api-key", "") + sent.headers.get("authorization", ""))
    assert KEY not in sent.content.decode()
    # ... and nothing the operator sees carries it or names an auth header.
    for text in (out, err):
        lowered = text.lower()
        for needle in FORBIDDEN:
            assert needle.lower() not in lowered, (needle, text)
    assert "I saw key [REDACTED]" in out and "[REDACTED HEADER]" in out


def test_key_file_errors_do_not_print_the_key(tmp_path, monkeypatch, capfd) -> None:
    # A key file given where a directory is expected: the error names the variable and
    # path, never file contents.
    monkeypatch.setenv(cmd.KEY_FILE_ENV, str(tmp_path))
    assert cmd.main([BASE]) == cmd.EXIT_USAGE
    out, err = capfd.readouterr()
    assert cmd.KEY_FILE_ENV in err and KEY not in out + err


def test_userinfo_in_base_url_is_not_printed(respx_mock, key_env, capfd) -> None:
    respx_mock.post("https://gw.test/v1/messages").mock(
        return_value=httpx.Response(200, content=_sse("db-green.internal"),
                                    headers={"content-type": "text/event-stream"}))
    cmd.main(["https://ops:hunter2@gw.test", "--repetitions", "1", "--case", "fact_update", "--json"])
    out, err = capfd.readouterr()
    assert "hunter2" not in out + err
    assert json.loads(out)["gateway"] == "https://gw.test"
