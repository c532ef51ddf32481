"""One streaming inference call per case, in the Anthropic Messages or OpenAI Chat shape.

The API key is passed in by the caller (read from a file in this process) and only ever
goes into the outgoing request headers; ``describe_request`` (what ``--show-requests``
prints) is built without them, and every text the gateway sends back is scrubbed of the
key before it is kept, in case a debugging proxy echoes request headers.
"""

from __future__ import annotations

import json
import os
import re
import ssl
import time
from collections.abc import Iterator
from typing import Any, Literal

import httpx
from pydantic import BaseModel

from deploy.preflight.cases import Case

Api = Literal["anthropic", "openai"]

ANTHROPIC_VERSION = "2023-06-01"
_ERROR_BODY_CHARS = 500


class GatewayConfig(BaseModel):
    base_url: str
    api: Api = "anthropic"
    model: str = "deepseek-v4-flash"
    thinking: Literal["adaptive", "budget"] = "adaptive"
    thinking_budget: int = 8192
    # Generous on purpose: with high thinking a small limit truncates the answer, and a
    # truncated answer fails the case.
    max_tokens: int = 16000
    timeout_s: float = 300.0


class CallOutcome(BaseModel):
    status_code: int | None = None
    request_id: str | None = None
    answer: str = ""
    thinking_observed: bool = False
    thinking_chars: int = 0
    stop_reason: str | None = None
    completed: bool = False  # the stream's final event arrived
    stream_error: str | None = None
    http_error: str | None = None  # excerpt of a non-200 body
    transport_error: str | None = None
    elapsed_ms: int = 0


def endpoint(cfg: GatewayConfig) -> str:
    path = "/v1/messages" if cfg.api == "anthropic" else "/v1/chat/completions"
    return cfg.base_url.rstrip("/") + path


def build_body(cfg: GatewayConfig, case: Case) -> dict[str, Any]:
    messages = [m.model_dump() for m in case.messages]
    if cfg.api == "openai":
        return {"model": cfg.model, "stream": True, "max_tokens": cfg.max_tokens,
                "reasoning_effort": "high",
                "messages": [{"role": "system", "content": case.system}, *messages]}
    if cfg.thinking == "adaptive":
        # Adaptive thinking defaults to high effort, so no separate effort field is sent
        # (an unknown field is one more thing a compatible gateway may reject).
        thinking: dict[str, Any] = {"type": "adaptive"}
        max_tokens = cfg.max_tokens
    else:
        thinking = {"type": "enabled", "budget_tokens": cfg.thinking_budget}
        max_tokens = max(cfg.max_tokens, cfg.thinking_budget + 4096)  # must exceed the budget
    return {"model": cfg.model, "stream": True, "max_tokens": max_tokens, "thinking": thinking,
            "system": case.system, "messages": messages}


def _public_headers(api: Api) -> dict[str, str]:
    headers = {"content-type": "application/json", "accept": "text/event-stream"}
    if api == "anthropic":
        headers["anthropic-version"] = ANTHROPIC_VERSION
    return headers


def _auth_headers(api: Api, key: str) -> dict[str, str]:
    return {"x-api-key": key} if api == "anthropic" else {"authorization": f"Bearer {key}"}


def describe_request(cfg: GatewayConfig, case: Case) -> dict[str, Any]:
    """The request as printed by ``--show-requests``: authentication headers left out."""
    return {"method": "POST", "url": endpoint(cfg), "headers": _public_headers(cfg.api),
            "body": build_body(cfg, case)}


def make_client(cfg: GatewayConfig, proxy: str | None) -> httpx.Client:
    # trust_env=False: the only proxy is CLOUD_AGENT_TEST_PROXY, so an ambient
    # HTTPS_PROXY cannot silently reroute the key. SSL_CERT_FILE is still honoured.
    cafile = os.environ.get("SSL_CERT_FILE")
    verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=cafile) if cafile else True
    timeout = httpx.Timeout(cfg.timeout_s, connect=15.0)
    return httpx.Client(proxy=proxy or None, timeout=timeout, trust_env=False, verify=verify)


def _sse(lines: Iterator[str]) -> Iterator[tuple[str | None, str]]:
    """(event name, data) per server-sent event."""
    event: str | None = None
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                yield event, "\n".join(data)
            event, data = None, []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:  # a last event without its blank line
        yield event, "\n".join(data)


def _error_text(err: Any) -> str:
    if isinstance(err, dict):
        kind = err.get("type") or err.get("code") or "error"
        return f"{kind}: {err.get('message', '')}".strip()
    return str(err)


def _on_anthropic(out: CallOutcome, event: str | None, payload: dict[str, Any]) -> None:
    kind = payload.get("type", event)
    if kind == "message_start":
        out.request_id = out.request_id or payload.get("message", {}).get("id")
    elif kind == "content_block_start":
        block = payload.get("content_block", {})
        if block.get("type") in ("thinking", "redacted_thinking"):
            out.thinking_observed = True
        elif block.get("type") == "text":
            out.answer += block.get("text", "")
    elif kind == "content_block_delta":
        delta = payload.get("delta", {})
        if delta.get("type") == "text_delta":
            out.answer += delta.get("text", "")
        elif delta.get("type") == "thinking_delta":
            out.thinking_observed = True
            out.thinking_chars += len(delta.get("thinking", ""))
    elif kind == "message_delta":
        out.stop_reason = payload.get("delta", {}).get("stop_reason") or out.stop_reason
    elif kind == "message_stop":
        out.completed = True
    elif kind == "error":
        out.stream_error = _error_text(payload.get("error", payload))


def _on_openai(out: CallOutcome, payload: dict[str, Any]) -> None:
    if "error" in payload:
        out.stream_error = _error_text(payload["error"])
        return
    out.request_id = out.request_id or payload.get("id")
    for choice in payload.get("choices") or []:
        delta = choice.get("delta") or {}
        out.answer += delta.get("content") or ""
        # DeepSeek-style gateways send reasoning_content; vLLM/OpenRouter send reasoning.
        reasoning = delta.get("reasoning_content") or delta.get("reasoning")
        if isinstance(reasoning, str) and reasoning:
            out.thinking_observed = True
            out.thinking_chars += len(reasoning)
        if choice.get("finish_reason"):
            out.stop_reason = choice["finish_reason"]
            out.completed = True


def _read_stream(out: CallOutcome, api: Api, lines: Iterator[str]) -> None:
    for event, data in _sse(lines):
        if api == "openai" and data.strip() == "[DONE]":
            out.completed = True
            continue
        try:
            payload = json.loads(data)
        except json.JSONDecodeError:
            out.stream_error = f"unparseable stream event: {data[:200]}"
            return
        if not isinstance(payload, dict):
            continue
        if api == "anthropic":
            _on_anthropic(out, event, payload)
        else:
            _on_openai(out, payload)
        if out.stream_error:
            return


# An echoed credential header, whatever key it carries (a proxy may add its own).
_AUTH_HEADER = re.compile(
    r"""(?:proxy-)?(?:authorization|x-api-key)["']?\s*[:=]\s*["']?(?:bearer\s+)?[^\s;,"'}]*""",
    re.IGNORECASE)


def _scrub(out: CallOutcome, key: str) -> CallOutcome:
    for name in ("answer", "request_id", "stream_error", "http_error", "transport_error", "stop_reason"):
        value = getattr(out, name)
        if isinstance(value, str):
            scrubbed = _AUTH_HEADER.sub("[REDACTED HEADER]", value)
            setattr(out, name, scrubbed.replace(key, "[REDACTED]") if key else scrubbed)
    return out


def call(client: httpx.Client, cfg: GatewayConfig, case: Case, key: str) -> CallOutcome:
    """Send ``case`` once and read the whole stream; never raises for gateway trouble."""
    out = CallOutcome()
    started = time.monotonic()
    headers = {**_public_headers(cfg.api), **_auth_headers(cfg.api, key)}
    try:
        with client.stream("POST", endpoint(cfg), json=build_body(cfg, case), headers=headers) as resp:
            out.status_code = resp.status_code
            out.request_id = resp.headers.get("request-id") or resp.headers.get("x-request-id")
            if resp.status_code != 200:
                resp.read()
                out.http_error = resp.text[:_ERROR_BODY_CHARS]
            else:
                _read_stream(out, cfg.api, resp.iter_lines())
    except httpx.HTTPError as exc:
        # After a 200 this is a cut stream (judged as truncation); before it, no answer.
        out.transport_error = f"{type(exc).__name__}: {exc}"
    out.elapsed_ms = int((time.monotonic() - started) * 1000)
    return _scrub(out, key)
