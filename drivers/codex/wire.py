"""Codex ``app-server`` wire protocol (0.171.0): message kinds, the per-turn tracker, errors.

Pure and synchronous, so recorded streams replay without a process. The session logic
(sending, reading, timeouts) lives in :mod:`drivers.codex.session`.

Wire facts this relies on (protocols/codex.md §4-§9, re-checked on captures under
tests/data/codex/): JSON-RPC without the ``jsonrpc`` member; the server's own requests carry
``method`` *and* ``id`` from a counter that collides with ours, so ``method`` decides the kind;
the only settlement is ``turn/completed`` whose ``turn.id`` is the id the ``turn/start``
response returned.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from enum import StrEnum
from typing import Any

from drivers.base import as_dict, as_str
from drivers.models import (
    DriverEvent,
    ErrorNotice,
    FailureReason,
    HandshakeReason,
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

EVIDENCE = "codex:turn/completed"


class Kind(StrEnum):
    RESPONSE = "response"  # {id, result|error}: answers one of our requests
    REQUEST = "request"  # {method, id, params}: the server asks us (approvals, user input)
    NOTIFICATION = "notification"  # {method, params}
    OTHER = "other"


def kind_of(msg: dict[str, Any]) -> Kind:
    method = msg.get("method")
    if isinstance(method, str):
        return Kind.REQUEST if "id" in msg else Kind.NOTIFICATION
    if "id" in msg and ("result" in msg or "error" in msg):
        return Kind.RESPONSE
    return Kind.OTHER


def rpc_error_message(msg: dict[str, Any]) -> str | None:
    """The error text of a response, None for a success (a malformed error is still an error)."""
    if "error" not in msg:
        return None
    err = msg.get("error")
    if isinstance(err, dict):
        text = err.get("message")
        return text if isinstance(text, str) else str(err)
    return str(err)


def resume_failure(message: str) -> HandshakeReason:
    """Map a ``thread/resume`` JSON-RPC error to the handshake reason.

    * "no rollout found for thread id …": the rollout is gone -> native_state_missing.
    * "invalid session id: …": the saved locator does not even parse as a thread id, so no
      rollout can exist for it. That is missing native state, not a mismatch:
      locator_mismatch is kept for a CLI that positively reports *another* session.
    * "… already has an active writer": another live process holds the thread; this process
      cannot serve it -> process_failed (the state itself is fine).
    """
    low = message.lower()
    if "no rollout found" in low or "invalid session id" in low or "thread not found" in low:
        return HandshakeReason.NATIVE_STATE_MISSING
    return HandshakeReason.PROCESS_FAILED


# ---------------------------------------------------------------- server-initiated requests

# With approvalPolicy "never" none of these should arrive. If one does, it is refused at
# once: a pending request would stall the turn forever. Decline (not cancel) lets the model
# see the refusal and finish its turn normally.
_DECLINES: dict[str, dict[str, Any]] = {
    "item/commandExecution/requestApproval": {"decision": "decline"},
    "item/fileChange/requestApproval": {"decision": "decline"},
    "item/permissions/requestApproval": {"permissions": {}},
    "mcpServer/elicitation/request": {"action": "decline"},
    "item/tool/requestUserInput": {"answers": {}},
    "item/tool/call": {"contentItems": [], "success": False},
    "execCommandApproval": {"decision": "denied"},
    "applyPatchApproval": {"decision": "denied"},
}


def answer_server_request(msg: dict[str, Any]) -> dict[str, Any]:
    """The reply to a server request: a refusal in the method's own shape, else a JSON-RPC error."""
    method = msg.get("method")
    result = _DECLINES.get(method) if isinstance(method, str) else None
    if result is not None:
        return {"id": msg.get("id"), "result": result}
    return {"id": msg.get("id"), "error": {"code": -32601, "message": f"cloud-agent does not serve {method!r}"}}


# ---------------------------------------------------------------- failure reasons

_RETRY_N = re.compile(r"(\d+)\s*/\s*\d+")
_STATUS_VARIANTS = ("responseTooManyFailedAttempts", "responseStreamDisconnected",
                    "responseStreamConnectionFailed", "httpConnectionFailed")
_CODE_REASONS = {
    "contextWindowExceeded": FailureReason.CONTEXT_TOO_LONG,
    "rateLimitExceeded": FailureReason.RATE_LIMITED,
    "usageLimitExceeded": FailureReason.RATE_LIMITED,
    "sessionBudgetExceeded": FailureReason.RATE_LIMITED,
    "serverOverloaded": FailureReason.OVERLOADED,
    "policyCapacityUnavailable": FailureReason.OVERLOADED,
    "flexUnavailable": FailureReason.OVERLOADED,
    "unauthorized": FailureReason.AUTH,
    # Codex replaces every 5xx body with its own "high demand" sentence, so the wording
    # says nothing about overload: a plain server error stays an API error.
    "internalServerError": FailureReason.API_ERROR,
}


def http_status(info: Any) -> int | None:
    """``httpStatusCode`` of an object-shaped ``codexErrorInfo`` variant."""
    for key in _STATUS_VARIANTS:
        status = as_dict(as_dict(info).get(key)).get("httpStatusCode")
        if isinstance(status, int) and not isinstance(status, bool):
            return status
    return None


def failure_reason(error: dict[str, Any]) -> FailureReason:
    """Why a failed turn failed, from ``turn.error`` (or an ``error`` notification's error).

    A 400 arrives as ``codexErrorInfo: "other"`` with the raw upstream body as message, so
    context-window wording is checked first; then Codex's own code; then the HTTP status
    carried by the object variants; then the wording.
    """
    message = as_str(error.get("message")) or ""
    details = as_str(error.get("additionalDetails")) or ""
    info = error.get("codexErrorInfo")
    if classify_failure(message, details) is FailureReason.CONTEXT_TOO_LONG:
        return FailureReason.CONTEXT_TOO_LONG
    if isinstance(info, str) and info in _CODE_REASONS:
        return _CODE_REASONS[info]
    status = http_status(info)
    if status is not None:
        if status == 429:
            return FailureReason.RATE_LIMITED
        if status in (503, 529):
            return FailureReason.OVERLOADED
        if status in (401, 403):
            return FailureReason.AUTH
        if status >= 500:
            return FailureReason.API_ERROR
    return classify_failure(message, details, status=status)


def error_detail(error: dict[str, Any]) -> str:
    parts = [as_str(error.get("message")), as_str(error.get("additionalDetails"))]
    info = error.get("codexErrorInfo")
    if info is not None:
        parts.append(f"codexErrorInfo={info}")
    return " | ".join(p for p in parts if p)


# ---------------------------------------------------------------- the turn tracker

_TOOL_ITEMS = frozenset({"commandExecution", "fileChange", "mcpToolCall", "dynamicToolCall",
                         "collabAgentToolCall", "webSearch", "imageView", "imageGeneration"})


def _tool_name(item: dict[str, Any]) -> str:
    kind = as_str(item.get("type")) or "tool"
    if kind == "mcpToolCall":
        return f"mcp:{item.get('server')}/{item.get('tool')}"
    if kind in ("dynamicToolCall", "collabAgentToolCall") and isinstance(item.get("tool"), str):
        return f"{kind}:{item['tool']}"
    return kind


def _tool_input(item: dict[str, Any]) -> Any:
    for key in ("command", "changes", "arguments", "query", "path", "prompt"):
        if key in item:
            return item[key]
    return None


def _tool_output(item: dict[str, Any]) -> str | None:
    for key in ("aggregatedOutput", "result", "contentItems", "error"):
        value = item.get(key)
        if value is not None:
            return value if isinstance(value, str) else str(value)
    return None


def _tool_failed(item: dict[str, Any]) -> bool:
    if item.get("status") in ("failed", "declined"):
        return True
    code = item.get("exitCode")
    if isinstance(code, int) and not isinstance(code, bool) and code != 0:
        return True
    return item.get("success") is False


class TurnTracker:
    """Consumes the notifications of one thread while one turn is active.

    ``feed`` returns the normalized events and sets ``settlement`` when the active turn's
    ``turn/completed`` arrives. Every notification is filtered by ``threadId`` and ``turnId``
    (sub-agents and other threads share the stream), except ``turn/completed`` itself: it is
    matched on the turn id alone so a report naming another thread for *our* turn surfaces
    as a different ``observed_locator`` instead of being dropped.
    """

    def __init__(self, thread_id: str, turn_id: str) -> None:
        self.thread_id = thread_id
        self.turn_id = turn_id
        self.settlement: Settlement | None = None
        self.compacted = False  # Codex compacted the thread's history during this turn
        self._deltas: dict[str, list[str]] = {}
        self._completed: list[str] = []
        self._open_tools: set[str] = set()

    @property
    def streamed_text(self) -> str:
        done = "\n\n".join(self._completed)
        return done or "".join("".join(parts) for parts in self._deltas.values())

    def _ours(self, params: dict[str, Any]) -> bool:
        thread = params.get("threadId")
        if thread is not None and thread != self.thread_id:
            return False
        turn = params.get("turnId")
        return turn is None or turn == self.turn_id

    def feed(self, msg: dict[str, Any]) -> list[DriverEvent]:
        if self.settlement is not None or kind_of(msg) is not Kind.NOTIFICATION:
            return []
        method = msg["method"]
        params = as_dict(msg.get("params"))
        if method == "turn/completed":
            return self._completed_turn(msg, params)
        if not self._ours(params):
            return []
        if method == "thread/compacted":
            self.compacted = True
            return [Notice(name="compacted", detail=None, raw=msg)]
        handler = _HANDLERS.get(method)
        return handler(self, msg, params) if handler is not None else []

    # -- handlers (all tolerant of missing or mistyped fields)

    def _delta(self, msg: dict[str, Any], params: dict[str, Any]) -> list[DriverEvent]:
        if params.get("turnId") != self.turn_id:
            return []
        delta = params.get("delta")
        if not isinstance(delta, str) or not delta:
            return []
        self._deltas.setdefault(str(params.get("itemId")), []).append(delta)
        return [TextDelta(text=delta, raw=msg)]

    def _item(self, msg: dict[str, Any], params: dict[str, Any], started: bool) -> list[DriverEvent]:
        if params.get("turnId") != self.turn_id:
            return []
        item = as_dict(params.get("item"))
        kind = item.get("type")
        item_id = str(item.get("id"))
        if kind == "contextCompaction":
            self.compacted = True
            return [Notice(name="compacted", detail=None, raw=msg)] if started else []
        if kind == "agentMessage" and not started:
            text = item.get("text")
            if isinstance(text, str) and text:
                self._completed.append(text)
            return []
        if not isinstance(kind, str) or kind not in _TOOL_ITEMS:  # any JSON may come: a dict is unhashable
            return []
        if started:
            self._open_tools.add(item_id)
            return [ToolStarted(call_id=item_id, tool=_tool_name(item), input=_tool_input(item), raw=msg)]
        self._open_tools.discard(item_id)
        return [ToolFinished(call_id=item_id, is_error=_tool_failed(item), output=_tool_output(item), raw=msg)]

    def _error(self, msg: dict[str, Any], params: dict[str, Any]) -> list[DriverEvent]:
        error = as_dict(params.get("error"))
        text = error_detail(error) or "error"
        if params.get("willRetry") is True:
            match = _RETRY_N.search(as_str(error.get("message")) or "")
            return [RetryNotice(attempt=int(match.group(1)) if match else None,
                                status=http_status(error.get("codexErrorInfo")), detail=text, raw=msg)]
        return [ErrorNotice(message=text, will_retry=False, raw=msg)]

    def _warning(self, msg: dict[str, Any], params: dict[str, Any]) -> list[DriverEvent]:
        return [Notice(name="warning", detail=as_str(params.get("message")), raw=msg)]

    def _completed_turn(self, msg: dict[str, Any], params: dict[str, Any]) -> list[DriverEvent]:
        turn = as_dict(params.get("turn"))
        if turn.get("id") != self.turn_id:
            return []
        thread = params.get("threadId")
        observed = Locator(id=thread) if isinstance(thread, str) and thread else None
        text = self._final_text(turn)
        status = turn.get("status")
        error = as_dict(turn.get("error"))
        if status == "completed":
            self.settlement = Settlement(evidence=EVIDENCE, is_error=False, observed_locator=observed,
                                         assistant_text=text, compacted=self.compacted, raw=[msg])
        elif status == "interrupted":
            self.settlement = Settlement(evidence=EVIDENCE, is_error=True, reason=FailureReason.ABORTED,
                                         detail=error_detail(error) or "turn interrupted",
                                         observed_locator=observed, assistant_text=text, compacted=self.compacted,
                                         raw=[msg])
        else:
            # "failed" (and any status this version does not know): the CLI ended the turn.
            detail = error_detail(error) or f"turn ended with status {status!r}"
            self.settlement = Settlement(evidence=EVIDENCE, is_error=True, reason=failure_reason(error),
                                         detail=detail, observed_locator=observed, assistant_text=text,
                                         compacted=self.compacted, raw=[msg])
        return []

    def _final_text(self, turn: dict[str, Any]) -> str:
        # turn.items (itemsView "summary") holds the turn's agent messages; fall back to what
        # was streamed when it is absent or empty (e.g. an interrupted turn).
        items = turn.get("items")
        if isinstance(items, list):
            texts = [i["text"] for i in items
                     if isinstance(i, dict) and i.get("type") == "agentMessage" and isinstance(i.get("text"), str)
                     and i["text"]]
            if texts:
                return "\n\n".join(texts)
        return self.streamed_text


_HANDLERS = {
    "item/agentMessage/delta": TurnTracker._delta,
    "item/started": lambda self, m, p: self._item(m, p, True),
    "item/completed": lambda self, m, p: self._item(m, p, False),
    "error": TurnTracker._error,
    "warning": TurnTracker._warning,
}


# ---------------------------------------------------------------- the template's tracker


class CodexTurnStart(TurnStart):
    thread_id: str
    request_id: int  # the id of this turn's turn/start request
    known_turns: list[str] = []  # native turn ids this process already saw: a turn/start answering
    # with one of them steered an old turn instead of starting one


class CodexTurn(Tracker):
    """One ``turn/start`` and what follows, for the shared turn template.

    Before the ``turn/start`` response names the native turn id, notifications are buffered
    (they may belong to it); server requests are refused at once in their method's own shape
    (a pending one would stall the turn). ``next_id`` allocates ids for ``turn/interrupt``
    requests (their answers are never read, so they do not affect the outcome).
    """

    drain_on_cancel = True  # a native turn left active would be steered by the next turn/start

    def __init__(self, start: CodexTurnStart, next_id: Callable[[], int]) -> None:
        self.start = start
        self._next_id = next_id
        self.turn_id: str | None = None
        self.evidence: TurnTracker | None = None  # created once the turn id is known
        self._early: list[dict[str, Any]] = []
        self._interrupt_wanted = False

    @property
    def accepted(self) -> bool:
        """turn/start succeeded: the thread is on disk from now on."""
        return self.evidence is not None

    @property
    def ended(self) -> bool:
        """The native turn ended (``turn/completed`` for it), whatever the outcome."""
        return self.evidence is not None and self.evidence.settlement is not None

    def opening(self, message: str) -> list[dict[str, Any]]:
        return [{"method": "turn/start", "id": self.start.request_id,
                 "params": {"threadId": self.start.thread_id, "input": [{"type": "text", "text": message}]}}]

    def feed(self, obj: dict[str, Any]) -> Step:
        kind = kind_of(obj)
        if kind is Kind.REQUEST:
            return Step(events=[Notice(name="server_request_refused", detail=str(obj.get("method")), raw=obj)],
                        send=[answer_server_request(obj)])
        if self.evidence is None:
            if kind is Kind.RESPONSE and obj.get("id") == self.start.request_id:
                return self._accepted(obj)
            if kind is Kind.NOTIFICATION:
                self._early.append(obj)  # may beat the turn/start response
            return Step()
        step = Step(events=self.evidence.feed(obj))
        step.outcome = self.evidence.settlement
        return step

    def _accepted(self, resp: dict[str, Any]) -> Step:
        if (err := rpc_error_message(resp)) is not None:
            return Step(outcome=NotSettled(reason=NotSettledReason.COMMAND_REJECTED, detail=f"turn/start: {err}"))
        turn_id = as_dict(as_dict(resp.get("result")).get("turn")).get("id")
        if not isinstance(turn_id, str) or not turn_id:
            return Step(outcome=NotSettled(reason=NotSettledReason.PROTOCOL_ERROR,
                                           detail="turn/start returned no turn id"))
        if turn_id in self.start.known_turns:
            return Step(outcome=NotSettled(reason=NotSettledReason.PROTOCOL_ERROR,
                                           detail=f"turn/start returned known turn {turn_id} (steered, not started)"))
        self.turn_id = turn_id
        self.evidence = TurnTracker(self.start.thread_id, turn_id)
        step = Step()
        for msg in self._early:
            step.events += self.evidence.feed(msg)
        self._early = []
        step.outcome = self.evidence.settlement
        if self._interrupt_wanted and step.outcome is None:
            step.send = self._interrupt_now()
        return step

    def _interrupt_now(self) -> list[dict[str, Any]]:
        assert self.turn_id is not None
        return [{"method": "turn/interrupt", "id": self._next_id(),
                 "params": {"threadId": self.start.thread_id, "turnId": self.turn_id}}]

    def interrupt(self) -> list[dict[str, Any]]:
        if self.ended:
            return []
        self._interrupt_wanted = True
        return self._interrupt_now() if self.turn_id is not None else []

    def partial_text(self) -> str:
        return self.evidence.streamed_text if self.evidence is not None else ""

    def end_of_stream(self, diagnostics: str) -> NotSettled:
        what = "turn/start" if self.evidence is None else "turn"
        tail = diagnostics.strip().splitlines()[-5:]
        return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED,
                          detail=f"{what}: stream ended" + (f"; stderr: {' | '.join(tail)}" if tail else ""),
                          assistant_text=self.partial_text())
