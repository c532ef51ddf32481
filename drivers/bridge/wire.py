"""The live bridge's line protocol, parsed (pure, no I/O): settlement and normalized events.

The bridge (``http-agent-live-bridge``) prints JSON lines; its ``settled`` line for the active
turn id is the only settlement evidence (SPEC section 5).
"""

from __future__ import annotations

from typing import Any

from drivers.models import (
    DriverEvent,
    FailureReason,
    Locator,
    Notice,
    RetryNotice,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from drivers.reasons import classify_failure

# Causes the bridge reports when it ended the turn itself: all are aborts of the native turn.
_BRIDGE_ABORTS = {"aborted", "stream_lost", "permission_failed", "question_failed"}
_REJECTED = {"prompt_rejected", "busy", "no_session", "bad_command", "unknown_command", "aborted"}


def failure_reason(obj: dict[str, Any]) -> FailureReason | None:
    """The failure reason of a ``settled`` line (None for a successful turn)."""
    if obj.get("ok") is True:
        return None
    if obj.get("reason") in _BRIDGE_ABORTS:
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
    if not ok and obj.get("reason") in _BRIDGE_ABORTS:
        detail = f"{obj.get('reason')}: {detail}" if detail and detail != obj.get("reason") else obj.get("reason")
    text = obj.get("text")
    return Settlement(evidence=f"{runtime}:bridge.settled", is_error=not ok, reason=failure_reason(obj), detail=detail,
                      observed_locator=Locator(id=sid) if isinstance(sid, str) and sid else None,
                      assistant_text=text if isinstance(text, str) else "", raw=[obj])


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
