"""The live bridge's line protocol, parsed (pure, no I/O): the turn tracker, settlement, events.

The bridge (``http-agent-live-bridge``) prints JSON lines; its ``settled`` line for the active
turn id is the only settlement evidence (SPEC section 5). Lines carrying another turn id are
late lines of an earlier turn and are dropped.
"""

from __future__ import annotations

from typing import Any

import structlog

from drivers.models import (
    DriverEvent,
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

log = structlog.get_logger("driver")

# Causes the bridge reports when it ended the turn itself: all are aborts of the native turn.
_BRIDGE_ABORTS = {"aborted", "stream_lost", "permission_failed", "question_failed"}
_REJECTED = {"prompt_rejected", "busy", "no_session", "bad_command", "unknown_command", "aborted"}


def _reason_in(obj: dict[str, Any], reasons: set[str]) -> bool:
    reason = obj.get("reason")
    return isinstance(reason, str) and reason in reasons  # a line is any JSON: a dict is unhashable


def failure_reason(obj: dict[str, Any]) -> FailureReason | None:
    """The failure reason of a ``settled`` line (None for a successful turn)."""
    if obj.get("ok") is True:
        return None
    if _reason_in(obj, _BRIDGE_ABORTS):
        return FailureReason.ABORTED
    err = obj.get("error") if isinstance(obj.get("error"), dict) else {}
    if err.get("name") == "MessageOutputLengthError":
        return FailureReason.TRUNCATED
    status = err.get("status") if isinstance(err.get("status"), int) else None
    return classify_failure(err.get("name"), err.get("message"), status=status)


def settlement_from(obj: dict[str, Any], runtime: str) -> Settlement:
    ok = obj.get("ok") is True
    sid = obj.get("session_id")
    err = obj.get("error") if isinstance(obj.get("error"), dict) else {}
    detail = None if ok else (str(err.get("message") or "") or str(obj.get("reason") or "")) or None
    if not ok and _reason_in(obj, _BRIDGE_ABORTS):
        detail = f"{obj.get('reason')}: {detail}" if detail and detail != obj.get("reason") else obj.get("reason")
    text = obj.get("text")
    return Settlement(evidence=f"{runtime}:bridge.settled", is_error=not ok, reason=failure_reason(obj), detail=detail,
                      observed_locator=Locator(id=sid) if isinstance(sid, str) and sid else None,
                      assistant_text=text if isinstance(text, str) else "", compacted=obj.get("compacted") is True,
                      raw=[obj])


def driver_events(obj: dict[str, Any], started: set[str]) -> list[DriverEvent]:
    """Normalized events for one bridge line of the active turn (``started``: tool call ids seen)."""
    kind = obj.get("type")
    if kind == "text" and isinstance(obj.get("delta"), str):
        return [TextDelta(text=obj["delta"], raw=obj)]
    if kind == "tool":
        call = str(obj.get("call_id") or "")
        status = obj.get("status")
        if obj.get("root") is not True:
            return [Notice(name="subagent_tool", detail=f"{obj.get('tool')} {status}", raw=obj)]
        out: list[DriverEvent] = []
        if status in ("pending", "running", "completed", "error") and call not in started:
            started.add(call)
            out.append(ToolStarted(call_id=call, tool=str(obj.get("tool") or ""), input=obj.get("input"), raw=obj))
        if status in ("completed", "error"):
            output = obj.get("output") if status == "completed" else obj.get("error")
            out.append(ToolFinished(call_id=call, is_error=status == "error",
                                    output=output if isinstance(output, str) else None, raw=obj))
        return out
    if kind == "status":
        status = obj.get("status") if isinstance(obj.get("status"), dict) else {}
        if status.get("type") == "retry":
            attempt = status.get("attempt") if isinstance(status.get("attempt"), int) else None
            return [RetryNotice(attempt=attempt, detail=str(status.get("message") or "") or None, raw=obj)]
        return [Notice(name=f"status:{status.get('type')}", detail=str(status.get("message") or "") or None, raw=obj)]
    if kind in ("permission", "question", "network"):
        ok = obj.get("ok")
        what = obj.get("permission") if kind == "permission" else obj.get("answers") if kind == "question" else obj.get("message")
        return [Notice(name=kind, detail=f"{what} ok={ok}", raw=obj)]
    return []


class BridgeTurnStart(TurnStart):
    turn_id: str  # the id the prompt carries; the bridge echoes it on the turn's lines


class BridgeTurn(Tracker):
    def __init__(self, start: BridgeTurnStart, runtime: str) -> None:
        self.start = start
        self.runtime = runtime
        self.started: set[str] = set()  # tool call ids already reported as started
        self.texts: list[str] = []

    def opening(self, message: str) -> list[dict[str, Any]]:
        return [{"type": "prompt", "turn_id": self.start.turn_id, "text": message}]

    def feed(self, obj: dict[str, Any]) -> Step:
        turn_id = obj.get("turn_id")
        if turn_id not in (None, self.start.turn_id):
            return Step()  # a late line of an earlier turn
        kind = obj.get("type")
        if kind == "settled" and turn_id == self.start.turn_id:
            return Step(outcome=settlement_from(obj, self.runtime))
        if kind == "error":
            return Step(outcome=self._error(obj))
        events = driver_events(obj, self.started)
        self.texts += [e.text for e in events if isinstance(e, TextDelta)]
        return Step(events=events)

    def _error(self, obj: dict[str, Any]) -> NotSettled | None:
        reason, detail = obj.get("reason"), f"{obj.get('reason')}: {obj.get('detail', '')}"
        if reason in ("stream_lost", "server_exited"):
            return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=detail, assistant_text=self.partial_text())
        if _reason_in(obj, _REJECTED) and obj.get("turn_id") is not None:
            return NotSettled(reason=NotSettledReason.COMMAND_REJECTED, detail=detail,
                              assistant_text=self.partial_text())
        log.warning("bridge.error", reason=reason, detail=obj.get("detail"))
        return None

    def interrupt(self) -> list[dict[str, Any]]:
        return [{"type": "abort"}]

    def partial_text(self) -> str:
        return "".join(self.texts)

    def end_of_stream(self, diagnostics: str) -> NotSettled:
        return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=f"the bridge exited: {diagnostics[-1000:]}",
                          assistant_text=self.partial_text())
