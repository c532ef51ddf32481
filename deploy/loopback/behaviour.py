"""Decide what the fixture answers to one model request: a reply plan, or an error.

The default reply is a pure function of the audited conversation (``expected_default_reply``)
so a test knows the exact assistant text before the CLI even runs.

Error wording is chosen for pi: pi 0.73.1 auto-retries any error message that contains
"500", "429", "502", "503", "504", "timeout", "terminated", "overloaded", "rate limit",
"server error", "internal error", "connection" … (protocols/pi.md §6). Terminal messages and
the context-window refusals below avoid all of them (the token counts 131072 and 200001 have
no such digit run); transient ones may match on purpose.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from typing import Any

from .audit import conversation, user_texts
from .models import (
    CutAction,
    FailAction,
    Message,
    RecallAction,
    RejectAction,
    ReplyAction,
    Rule,
    StallAction,
    ToolCallAction,
)

TITLE_REPLY = "Fixture Title"
CONTEXT_LIMIT, CONTEXT_USED = 131072, 200001
ANTHROPIC_CONTEXT_MESSAGE = f"prompt is too long: {CONTEXT_USED} tokens > {CONTEXT_LIMIT} maximum"
OPENAI_CONTEXT_MESSAGE = (
    f"This model's maximum context length is {CONTEXT_LIMIT} tokens. However, your messages resulted in "
    f"{CONTEXT_USED} tokens. Please reduce the length of the messages."
)
TERMINAL_MESSAGE = "fixture: request rejected (terminal)"


def default_reply(user_texts_: list[str]) -> str:
    """``"ok {n}: {sha256(last user text)[:10]}"``, n = number of audited user messages."""
    last = user_texts_[-1] if user_texts_ else ""
    return f"ok {len(user_texts_)}: {hashlib.sha256(last.encode('utf-8')).hexdigest()[:10]}"


# The name tests are told to call; kept as an alias so both spellings work.
expected_default_reply = default_reply


def summary_reply(user_texts_: list[str]) -> str:
    return f"Fixture summary of {len(user_texts_)} user message(s)."


# ---------------------------------------------------------------- plans


def split_deltas(text: str, pieces: int = 4) -> list[str]:
    """Split ``text`` into up to ``pieces`` non-empty chunks whose concatenation is ``text``."""
    if not text:
        return []
    n = min(pieces, len(text))
    size = -(-len(text) // n)
    return [text[i:i + size] for i in range(0, len(text), size)]


@dataclass
class TextOut:
    text: str


@dataclass
class ToolOut:
    call_id: str
    name: str
    arguments: str  # JSON text


@dataclass
class Plan:
    """What to send back. ``status != 200`` means an error body instead of a stream."""

    status: int = 200
    items: list[TextOut | ToolOut] = field(default_factory=list)
    error_body: dict[str, Any] | None = None
    headers: dict[str, str] = field(default_factory=dict)
    cut_after: int | None = None
    abort: bool = False
    stall: float | None = None
    rule: str | None = None
    action: str = "default"

    @property
    def reply_text(self) -> str | None:
        """The assistant text the client receives (only the streamed part of a cut reply)."""
        texts = [i.text for i in self.items if isinstance(i, TextOut)]
        if not texts:
            return None
        if self.cut_after is not None:
            return "".join([d for t in texts for d in split_deltas(t)][: self.cut_after])
        return "".join(texts)

    @property
    def tool_call(self) -> dict[str, Any] | None:
        for i in self.items:
            if isinstance(i, ToolOut):
                return {"call_id": i.call_id, "name": i.name, "arguments": i.arguments}
        return None


# ---------------------------------------------------------------- vendor error bodies


_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    500: "api_error", 503: "api_error", 529: "overloaded_error"}
_ANTHROPIC_TEXT = {429: "Number of request tokens has exceeded your rate limit (fixture)",
                   500: "Internal server error (fixture)", 503: "Service unavailable (fixture)",
                   529: "Overloaded"}
_OPENAI_TYPES = {400: ("invalid_request_error", None), 401: ("invalid_request_error", "invalid_api_key"),
                 404: ("invalid_request_error", "not_found"), 429: ("requests", "rate_limit_exceeded"),
                 500: ("server_error", None), 503: ("server_error", "service_unavailable")}
_OPENAI_TEXT = {429: "Rate limit reached for requests (fixture)",
                500: "The server had an error while processing your request (fixture)",
                503: "The engine is currently overloaded, please try again later (fixture)"}


def error_body(api: str, status: int, message: str | None = None, code: str | None = None) -> dict[str, Any]:
    """The vendor's error object for ``api`` (Anthropic shape for ``anthropic``, OpenAI otherwise)."""
    if api == "anthropic":
        etype = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": etype, "message": message or _ANTHROPIC_TEXT.get(status, TERMINAL_MESSAGE)}}
    etype, ecode = _OPENAI_TYPES.get(status, ("server_error" if status >= 500 else "invalid_request_error", None))
    return {"error": {"message": message or _OPENAI_TEXT.get(status, TERMINAL_MESSAGE), "type": etype,
                      "param": None, "code": code if code is not None else ecode}}


# ---------------------------------------------------------------- tools in a request


def request_tools(body: dict[str, Any], api: str) -> list[tuple[str, dict[str, Any]]]:
    """(name, JSON schema of the arguments) of every function tool the request offers."""
    out: list[tuple[str, dict[str, Any]]] = []
    for tool in body.get("tools") or []:
        if not isinstance(tool, dict):
            continue
        if api == "anthropic" and "name" in tool:
            out.append((tool["name"], tool.get("input_schema") or {}))
        elif api == "chat" and isinstance(tool.get("function"), dict):
            out.append((tool["function"].get("name", ""), tool["function"].get("parameters") or {}))
        elif api == "responses" and tool.get("type") == "function" and "name" in tool:
            out.append((tool["name"], tool.get("parameters") or {}))
    return out


def _pick_tool(action: ToolCallAction, tools: list[tuple[str, dict[str, Any]]]) -> tuple[str, dict[str, Any]]:
    candidates = [action.name] if isinstance(action.name, str) else list(action.name)
    for cand in candidates:
        for name, schema in tools:
            if name.lower() == cand.lower():
                return name, schema
    return candidates[0], {}


def _tool_arguments(action: ToolCallAction, schema: dict[str, Any]) -> str:
    if action.shell is not None:
        props = schema.get("properties") or {}
        key = "cmd" if "cmd" in props and "command" not in props else "command"
        args: dict[str, Any] = {key: action.shell}
        if "description" in (schema.get("required") or []):
            args["description"] = "fixture command"
        return json.dumps(args)
    if isinstance(action.arguments, str):
        return action.arguments
    return json.dumps(action.arguments or {})


# ---------------------------------------------------------------- the decision


class Behaviour:
    """The rules of one fixture plus the tool calls it has issued (thread-safe)."""

    def __init__(self, rules: list[Rule] | None = None) -> None:
        self._lock = threading.Lock()
        self._rules: list[Rule] = list(rules or [])
        self._issued: dict[str, str] = {}  # call_id -> then_reply

    def add(self, rules: list[Rule]) -> None:
        with self._lock:
            self._rules.extend(rules)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def rules(self) -> list[Rule]:
        with self._lock:
            return [r.model_copy(deep=True) for r in self._rules]

    def _take_rule(self, text: str, api: str, kind: str) -> Rule | None:
        with self._lock:
            for rule in self._rules:
                if rule.matches(text, api, kind):
                    if rule.times is not None:
                        rule.times -= 1
                    return rule.model_copy(deep=True)
        return None

    def decide(self, body: dict[str, Any], api: str, kind: str, seq: int) -> Plan:
        conv = conversation(body, api)
        users = user_texts(conv)
        last = users[-1] if users else ""
        if conv and conv[-1].role == "tool_result" and kind == "conversation":
            return self._followup(conv[-1])
        rule = self._take_rule(last, api, kind)
        if rule is not None:
            return self._apply(rule, body, api, users, seq)
        if kind == "title":
            return Plan(items=[TextOut(TITLE_REPLY)], action="side")
        if kind == "summary":
            return Plan(items=[TextOut(summary_reply(users))], action="side")
        return Plan(items=[TextOut(default_reply(users))])

    def _followup(self, result: Message) -> Plan:
        with self._lock:
            text = self._issued.get(result.call_id or "", "done")
        return Plan(items=[TextOut(text)], action="tool_followup")

    def _apply(self, rule: Rule, body: dict[str, Any], api: str, users: list[str], seq: int) -> Plan:
        a = rule.action
        plan = Plan(rule=rule.id, action=a.type)
        if isinstance(a, ReplyAction):
            plan.items = [TextOut(a.text)]
        elif isinstance(a, RecallAction):
            recalled = users[a.index] if -len(users) <= a.index < len(users) else "(no such user message)"
            plan.items = [TextOut(a.prefix + recalled)]
        elif isinstance(a, ToolCallAction):
            name, schema = _pick_tool(a, request_tools(body, api))
            call_id = (f"toolu_fx{seq:06d}" if api == "anthropic" else f"call_fx{seq:06d}")
            with self._lock:
                self._issued[call_id] = a.then_reply
            plan.items = [ToolOut(call_id, name, _tool_arguments(a, schema))]
        elif isinstance(a, FailAction):
            plan.status = a.status
            plan.error_body = error_body(api, a.status, a.message)
            if a.retry_after is not None:
                plan.headers["retry-after"] = f"{a.retry_after:g}"
            if a.retry_after_ms is not None:
                plan.headers["retry-after-ms"] = str(a.retry_after_ms)
        elif isinstance(a, RejectAction):
            plan.status = a.status
            if a.context_window:
                msg = ANTHROPIC_CONTEXT_MESSAGE if api == "anthropic" else OPENAI_CONTEXT_MESSAGE
                plan.error_body = error_body(api, a.status, a.message or msg,
                                             code=None if api == "anthropic" else "context_length_exceeded")
                if api != "anthropic":
                    plan.error_body["error"]["param"] = "messages" if api == "chat" else "input"
            else:
                plan.error_body = error_body(api, a.status, a.message or TERMINAL_MESSAGE)
        elif isinstance(a, CutAction):
            plan.items = [TextOut(a.text or default_reply(users))]
            plan.cut_after, plan.abort = a.after_deltas, a.abort
        elif isinstance(a, StallAction):
            plan.items = [TextOut(a.text or default_reply(users))]
            plan.stall = a.seconds
        return plan
