"""Claude Code stream-json protocol: pure parsing, no I/O (pinned CLI 2.1.220).

Everything here works on already-decoded JSON objects and never raises on odd shapes: the
stream-json schema is undocumented and grows every release, so unknown types, subtypes and
fields are ignored and every field is type-checked before use.

:class:`TurnTracker` holds one turn's evidence. It is fed raw objects in stream order and
says when the turn is settled (protocols/claude-code.md section 5):

* a top-level ``result`` (``parent_tool_use_id`` absent/null, no ``origin`` key — results
  with ``origin`` belong to the CLI's own task-notification turns) that follows the turn's
  root ``system/init`` (2.1.220 prints init at the start of every turn; a result before it
  is left over from an earlier, unsettled turn);
* then ``system/session_state_changed`` ``idle`` when state events are on;
* and no background task outstanding.

The session id is taken only from ROOT events (no / null ``parent_tool_use_id``), checked on
the raw object before any normalization (SPEC section 4.4).
"""

from __future__ import annotations

import re
import uuid as uuidlib
from typing import Any

from drivers.base import as_str
from drivers.models import (
    DriverEvent,
    ErrorNotice,
    FailureReason,
    Locator,
    Notice,
    NotSettled,
    NotSettledReason,
    RetryNotice,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from drivers.reasons import classify_failure
from drivers.session import Step, Tracker, TurnStart

EVIDENCE = "claude:result"
PROJECT_DIR_MAX = 200  # the CLI cuts sanitised project directory names here

_NOT_ALNUM = re.compile(r"[^a-zA-Z0-9]")
_CONTEXT_WORDING = re.compile(r"prompt is too long|context window|context length|too many tokens", re.IGNORECASE)


# ---------------------------------------------------------------- transcript location


def _js_string_hash(text: str) -> int:
    """Java-style 32-bit string hash over UTF-16 code units, as the CLI computes it."""
    h = 0
    data = text.encode("utf-16-le", "surrogatepass")
    for i in range(0, len(data), 2):
        h = ((h << 5) - h + int.from_bytes(data[i:i + 2], "little")) & 0xFFFFFFFF
    return h - (1 << 32) if h & 0x80000000 else h


def _base36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    out = ""
    while True:
        n, r = divmod(n, 36)
        out = digits[r] + out
        if n == 0:
            return out


def sanitize_project_dir(cwd: str) -> str:
    """The directory name Claude Code keys a cwd's transcripts by.

    Every UTF-16 code unit outside ``[a-zA-Z0-9]`` becomes ``-`` (so a non-BMP character
    gives two dashes, as in JavaScript). Names longer than 200 units are cut to 200 and get
    ``-<base36 of |hash|>`` appended, the hash being taken over the original cwd.
    """
    units = cwd.encode("utf-16-le", "surrogatepass")
    chars = []
    for i in range(0, len(units), 2):
        code = int.from_bytes(units[i:i + 2], "little")
        chars.append(chr(code) if code < 128 and _NOT_ALNUM.match(chr(code)) is None else "-")
    name = "".join(chars)
    if len(name) <= PROJECT_DIR_MAX:
        return name
    return f"{name[:PROJECT_DIR_MAX]}-{_base36(abs(_js_string_hash(cwd)))}"


def transcript_path(config_dir: str, cwd: str, session_id: str) -> str:
    return f"{config_dir.rstrip('/')}/projects/{sanitize_project_dir(cwd)}/{session_id}.jsonl"


def is_uuid(value: str) -> bool:
    try:
        return str(uuidlib.UUID(value)) == value.lower()
    except (ValueError, AttributeError, TypeError):
        return False


# ---------------------------------------------------------------- stdin lines


def user_line(message: str) -> dict[str, Any]:
    """The stdin object carrying ``message`` unchanged.

    In stream-json mode the CLI runs a message whose (last) text starts with ``/`` as a slash
    command: ``/help`` never reaches the model, ``/clear`` even starts a NEW session id. It
    only looks at the last text block, and drops empty text blocks before calling the API, so
    a trailing empty block makes the text reach the model byte-for-byte (verified on 2.1.220,
    also after a resume). Other messages go as a plain string, the documented shape.
    """
    content: Any = message
    if message.startswith("/"):
        content = [{"type": "text", "text": message}, {"type": "text", "text": ""}]
    return {"type": "user", "message": {"role": "user", "content": content}, "parent_tool_use_id": None,
            "session_id": ""}


def control_request(subtype: str, request_id: str | None = None) -> dict[str, Any]:
    return {"type": "control_request", "request_id": request_id or f"ca-{uuidlib.uuid4().hex[:12]}",
            "request": {"subtype": subtype}}


def control_error_reply(request_id: str, message: str) -> dict[str, Any]:
    return {"type": "control_response",
            "response": {"subtype": "error", "request_id": request_id, "error": message}}


# ---------------------------------------------------------------- event helpers


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def is_root(obj: dict[str, Any]) -> bool:
    """Root = not a child agent's event: ``parent_tool_use_id`` absent or null (raw object)."""
    return obj.get("parent_tool_use_id") is None


def root_session_id(obj: dict[str, Any]) -> str | None:
    """The session id a ROOT event reports; None for child events and events without one."""
    if not is_root(obj):
        return None
    sid = obj.get("session_id")
    return sid if isinstance(sid, str) and sid else None


def is_turn_result(obj: dict[str, Any]) -> bool:
    """The user turn's own result: top-level, and not a CLI notification turn (``origin``)."""
    return obj.get("type") == "result" and is_root(obj) and "origin" not in obj


def control_response_for(obj: dict[str, Any], request_id: str) -> dict[str, Any] | None:
    """The inner ``response`` envelope when ``obj`` answers ``request_id``."""
    if obj.get("type") != "control_response":
        return None
    resp = obj.get("response")
    if isinstance(resp, dict) and resp.get("request_id") == request_id:
        return resp
    return None


def result_errors(obj: dict[str, Any]) -> str:
    errors = obj.get("errors")
    if isinstance(errors, list):
        return "; ".join(str(e) for e in errors)
    return ""


def failure_reason(result: dict[str, Any]) -> FailureReason:
    """Why an ``is_error`` result failed, from the CLI's own fields (never ``subtype`` alone)."""
    terminal = as_str(result.get("terminal_reason")) or ""
    status = _int(result.get("api_error_status"))
    text = as_str(result.get("result")) or ""
    errors = result_errors(result)
    if terminal == "prompt_too_long" or (status == 400 and _CONTEXT_WORDING.search(text)):
        return FailureReason.CONTEXT_TOO_LONG
    if terminal == "max_turns" or result.get("subtype") == "error_max_turns":
        return FailureReason.TRUNCATED
    if terminal.startswith("aborted"):
        return FailureReason.ABORTED
    if status == 429:
        return FailureReason.RATE_LIMITED
    if status == 529 or "overloaded" in text.lower():
        return FailureReason.OVERLOADED
    if status in (401, 403):
        return FailureReason.AUTH
    if status is not None or terminal == "api_error":
        return FailureReason.API_ERROR
    return classify_failure(text, errors, terminal, status=status)


def _tool_output(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [b["text"] for b in content if isinstance(b, dict) and isinstance(b.get("text"), str)]
        return "\n".join(parts)
    return None


def normalize(obj: dict[str, Any]) -> list[DriverEvent]:
    """Normalized events for one raw object (``raw=`` the object). Never raises."""
    kind = obj.get("type")
    root = is_root(obj)
    message = obj.get("message")
    content = message.get("content") if isinstance(message, dict) else None
    out: list[DriverEvent] = []
    if kind == "assistant" and isinstance(content, list):
        for block in content:
            if not isinstance(block, dict):
                continue
            btype = block.get("type")
            if btype == "text" and isinstance(block.get("text"), str) and root:
                out.append(TextDelta(text=block["text"], raw=obj))
            elif btype == "tool_use":
                call_id, name = as_str(block.get("id")) or "", as_str(block.get("name")) or ""
                if root:
                    out.append(ToolStarted(call_id=call_id, tool=name, input=block.get("input"), raw=obj))
                else:
                    out.append(Notice(name="subagent.tool_started", detail=name, raw=obj))
    elif kind == "user" and isinstance(content, list):
        for block in content:
            if isinstance(block, dict) and block.get("type") == "tool_result":
                call_id = as_str(block.get("tool_use_id")) or ""
                if root:
                    out.append(ToolFinished(call_id=call_id, is_error=block.get("is_error") is True,
                                            output=_tool_output(block.get("content")), raw=obj))
                else:
                    out.append(Notice(name="subagent.tool_finished", detail=call_id, raw=obj))
    elif kind == "system":
        sub = obj.get("subtype")
        if sub == "api_retry":
            detail = as_str(obj.get("error"))
            out.append(RetryNotice(attempt=_int(obj.get("attempt")), status=_int(obj.get("error_status")),
                                   detail=detail, raw=obj))
        elif sub in ("status", "compact_boundary", "task_started", "task_notification", "permission_denied"):
            detail = as_str(obj.get("status")) or as_str(obj.get("description")) or as_str(obj.get("tool_name"))
            out.append(Notice(name=f"claude.{sub}", detail=detail, raw=obj))
    elif kind == "result" and root and obj.get("is_error") is True and "origin" not in obj:
        msg = as_str(obj.get("result")) or result_errors(obj) or as_str(obj.get("terminal_reason")) or "error"
        out.append(ErrorNotice(message=msg, raw=obj))
    return out


# ---------------------------------------------------------------- one turn


class TurnTracker:
    """The evidence of one turn, fed raw objects in stream order."""

    def __init__(self, expected: str | None, *, state_events: bool = True) -> None:
        self.expected = expected
        self.state_events = state_events
        self.first_root_id: str | None = None
        self.mismatch_id: str | None = None  # first root id that differs from the expected one
        self.cli_version: str | None = None
        self.result: dict[str, Any] | None = None
        self.idle_after_result = False
        self.started_tasks: set[str] = set()
        self.finished_tasks: set[str] = set()
        self.background: list[Any] = []  # latest background_tasks_changed.tasks
        self.retried = False
        self.compacted = False  # a root compact_boundary in this turn (native compaction on)
        self.texts: list[str] = []
        self.ignored_results = 0
        self.stale_results = 0
        self.early_idles = 0
        self.init_seen = False
        self.events = 0

    # -- feeding

    def feed(self, obj: dict[str, Any]) -> list[DriverEvent]:
        self.events += 1
        sid = root_session_id(obj)
        if sid is not None:
            if self.first_root_id is None:
                self.first_root_id = sid
            reference = self.expected if self.expected is not None else self.first_root_id
            if sid != reference and self.mismatch_id is None:
                self.mismatch_id = sid
        kind = obj.get("type")
        if kind == "system":
            self._system(obj)
        elif kind == "result":
            if is_turn_result(obj) and not self.init_seen:
                # A result before this turn's init ends an EARLIER turn (e.g. the aborted one
                # after a cancellation whose lines were never read): never this turn's.
                self.stale_results += 1
            elif is_turn_result(obj):
                if self.result is None:
                    self.result = obj
                    self.idle_after_result = False
            else:
                self.ignored_results += 1
        events = normalize(obj)
        self.texts += [e.text for e in events if isinstance(e, TextDelta)]
        return events

    def _system(self, obj: dict[str, Any]) -> None:
        sub = obj.get("subtype")
        if sub == "init" and is_root(obj):
            self.init_seen = True
            version = as_str(obj.get("claude_code_version"))
            if version:
                self.cli_version = version
        elif sub == "api_retry":
            self.retried = True
        elif sub == "compact_boundary" and is_root(obj) and self.init_seen:
            self.compacted = True
        elif sub == "session_state_changed" and self.result is not None:
            state = obj.get("state")
            if state == "running":
                self.idle_after_result = False  # the CLI started more work (a notification turn)
            elif state == "idle":
                if self._quiet():
                    self.idle_after_result = True
                else:
                    # 2.1.220 says idle while a background agent still runs (notes section 5);
                    # only an idle with nothing outstanding counts.
                    self.early_idles += 1
        elif sub == "task_started":
            task = as_str(obj.get("task_id"))
            if task:
                self.started_tasks.add(task)
        elif sub == "task_notification":
            task = as_str(obj.get("task_id"))
            if task:
                self.finished_tasks.add(task)
        elif sub == "background_tasks_changed":
            tasks = obj.get("tasks")
            self.background = tasks if isinstance(tasks, list) else []

    # -- verdicts

    @property
    def init_mismatch(self) -> bool:
        return self.mismatch_id is not None

    @property
    def outstanding_tasks(self) -> set[str]:
        return self.started_tasks - self.finished_tasks

    def _quiet(self) -> bool:
        return not self.outstanding_tasks and not self.background

    @property
    def settled(self) -> bool:
        if self.result is None:
            return False
        if self.state_events and not self.idle_after_result:
            return False
        return self._quiet()

    def observed_locator(self) -> Locator | None:
        sid = self.mismatch_id or self.first_root_id
        return Locator(id=sid) if sid else None

    def assistant_text(self) -> str:
        if self.result is not None and isinstance(self.result.get("result"), str):
            return self.result["result"]
        return "".join(self.texts)

    def partial_text(self) -> str:
        return "".join(self.texts)

    def settlement(self) -> Settlement:
        assert self.result is not None
        result = self.result
        is_error = result.get("is_error") is True
        reason = failure_reason(result) if is_error else None
        detail = None
        if is_error:
            detail = as_str(result.get("result")) or result_errors(result) or as_str(result.get("terminal_reason"))
        return Settlement(evidence=EVIDENCE, is_error=is_error, reason=reason, detail=detail,
                          observed_locator=self.observed_locator(), assistant_text=self.assistant_text(),
                          retire_after=self.retried, compacted=self.compacted, raw=[result])


# ---------------------------------------------------------------- the template's tracker


class ClaudeTurnStart(TurnStart):
    expected: str | None  # the root session id this turn must report
    state_events: bool = True  # CLAUDE_CODE_EMIT_SESSION_STATE_EVENTS: settlement waits for idle


class ClaudeTurn(Tracker):
    """One user message and what follows, for the shared turn template: the evidence is a
    :class:`TurnTracker`; control requests (only sent with ``--permission-prompt-tool stdio``,
    which the driver never passes) are refused at once, as an unanswered one would block the
    turn; when another session answers (a root id other than the expected one) the turn is
    interrupted once to stop spending tokens — the settlement still reports that id and the
    runner fails the turn."""

    def __init__(self, start: ClaudeTurnStart) -> None:
        self.start = start
        self.evidence = TurnTracker(start.expected, state_events=start.state_events)
        self.mismatch_interrupted = False
        self.last_assistant_uuid: str | None = None  # = its transcript entry uuid: a fork anchor
        self._interrupts = 0

    def opening(self, message: str) -> list[dict[str, Any]]:
        return [user_line(message)]

    def feed(self, obj: dict[str, Any]) -> Step:
        kind = obj.get("type")
        if kind == "control_request":
            request_id = obj.get("request_id")
            if not isinstance(request_id, str):
                return Step()
            return Step(send=[control_error_reply(request_id, "not supported by this supervisor")])
        if kind == "control_response":
            return Step()  # the answer to our interrupt
        step = Step(events=self.evidence.feed(obj))
        if kind == "assistant" and is_root(obj) and isinstance(obj.get("uuid"), str):
            self.last_assistant_uuid = obj["uuid"]
        if self.evidence.init_mismatch and not self.mismatch_interrupted:
            self.mismatch_interrupted = True
            step.send = self.interrupt()
        if self.evidence.settled:
            step.outcome = self.evidence.settlement()
        return step

    def interrupt(self) -> list[dict[str, Any]]:
        self._interrupts += 1
        return [control_request("interrupt", f"ca-{self.start.turn}-interrupt-{self._interrupts}")]

    def partial_text(self) -> str:
        return self.evidence.partial_text()

    def end_of_stream(self, diagnostics: str) -> NotSettled:
        detail = "stream ended before settlement"
        if self.evidence.result is not None:
            detail = "stream ended after the result but before idle"
        return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=detail, assistant_text=self.partial_text())
