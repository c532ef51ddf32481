"""Pi RPC wire parsing and the settlement rule (pinned @mariozechner/pi-coding-agent 0.73.1).

Sans-IO: :class:`PiTurn` is fed every JSON object pi prints during one turn and answers
with what the session must do (send a ``get_state`` barrier, stop because the turn settled
or was rejected); :class:`PiTracker` is that rule as the shared template's tracker (it owns
the ids of everything it sends, so a recorded turn replays to the same outcome). It never raises on odd input: any field may be missing or of the wrong
type (hypothesis tests feed it garbage).

Why a barrier (protocols/pi.md §4): ``agent_end`` is not settlement in 0.73.1. In the same
tick as ``agent_end`` pi may emit ``auto_retry_start`` (a retry sleep follows, then a new
``agent_start``) or ``compaction_start`` (overflow recovery, maybe a re-run). stdin is read
only after that tick, so a ``get_state`` sent *after* reading ``agent_end`` is answered after
any such follow-on event. The turn is settled when a barrier answer arrives while no retry
or compaction is pending and pi itself says ``isStreaming: false, isCompacting: false``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from drivers.base import as_dict, as_list, as_str
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
from drivers.session import Step as TurnStep
from drivers.session import Tracker, TurnStart

EVIDENCE = "pi:agent_end+get_state"
TEXT_JOINER = "\n\n"

# pi's own wording when no API key resolves (recorded with the `!printenv` apiKey the driver used until stop 26)
_KEY_MISSING = re.compile(r"Failed to resolve API key|No API key found", re.IGNORECASE)
_STATUS = re.compile(r"^\s*(\d{3})\b")


def message_text(message: dict[str, Any]) -> str:
    """The text blocks of one pi message, concatenated (tool calls and thinking excluded)."""
    content = message.get("content")
    if isinstance(content, str):
        return content
    return "".join(b["text"] for b in as_list(content)
                   if isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str))


def last_assistant(messages: Any) -> dict[str, Any] | None:
    for m in reversed(as_list(messages)):
        if isinstance(m, dict) and m.get("role") == "assistant":
            return m
    return None


def http_status(error_message: str | None) -> int | None:
    """pi prefixes provider errors with the HTTP status ("400 {...}", "500 ...")."""
    m = _STATUS.match(error_message or "")
    return int(m.group(1)) if m else None


def failure_reason(stop_reason: str | None, error_message: str | None, *, aborted: bool = False) -> FailureReason:
    """Why a settled pi turn failed, from the final assistant message."""
    if stop_reason == "aborted" or aborted:
        return FailureReason.ABORTED
    if stop_reason == "length":
        return FailureReason.TRUNCATED
    if error_message and _KEY_MISSING.search(error_message):
        return FailureReason.AUTH
    return classify_failure(error_message, status=http_status(error_message))


def state_locator(data: dict[str, Any]) -> Locator | None:
    """Locator(id=sessionId, path=sessionFile) from a ``get_state`` answer, if both are there."""
    sid, path = as_str(data.get("sessionId")), as_str(data.get("sessionFile"))
    if not sid or not path:
        return None
    return Locator(id=sid, path=path)


def tool_output(result: Any) -> str | None:
    if isinstance(result, str):
        return result
    texts = [b["text"] for b in as_list(as_dict(result).get("content"))
             if isinstance(b, dict) and isinstance(b.get("text"), str)]
    return "".join(texts) if texts else None


@dataclass
class Step:
    """What the session must do after feeding one object."""

    events: list[DriverEvent] = field(default_factory=list)
    send_barrier: bool = False
    rejected: str | None = None  # prompt refused (success:false): error text
    settlement: Settlement | None = None
    no_evidence: str | None = None  # pi said the run is over but gave no outcome to settle on


@dataclass
class PiTurn:
    """Settlement tracker for one ``prompt`` (protocols/pi.md §3-§4).

    ``prompt_id`` is the id of our ``prompt`` command; ``barrier_ids`` are the ids of the
    ``get_state`` barriers the session sent (the session registers each one with
    :meth:`barrier_sent`). ``aborted`` is set when we sent ``abort`` ourselves.
    """

    prompt_id: str
    accepted: bool = False
    started: bool = False  # our agent_start seen: events before it are stale (old compaction_*)
    running: bool = False
    compacting: bool = False
    aborted: bool = False
    barrier_ids: set[str] = field(default_factory=set)
    barrier_outstanding: bool = False
    last_end: dict[str, Any] | None = None
    final_message: dict[str, Any] | None = None  # last assistant message_end of the turn
    run_texts: list[str] = field(default_factory=list)  # assistant texts of the latest agent run
    streamed: list[str] = field(default_factory=list)
    assistant_ended: bool = False  # an assistant message_end was seen (the session file is flushed)
    retries: int = 0
    compacted: bool = False  # a compaction of this turn (overflow recovery or threshold)
    pending_error: dict[str, Any] | None = None
    retry_cancelled: bool = False

    @property
    def streamed_text(self) -> str:
        return "".join(self.streamed)

    def barrier_sent(self, barrier_id: str) -> None:
        self.barrier_ids.add(barrier_id)
        self.barrier_outstanding = True

    # ------------------------------------------------------------------ feeding

    def feed(self, obj: dict[str, Any]) -> Step:
        step = Step()
        kind = obj.get("type")
        if kind == "response":
            self._on_response(obj, step)
            return step
        if not isinstance(kind, str):
            return step
        if kind == "agent_start":
            if not self.accepted:
                return step  # not ours: our prompt was not even accepted yet
            self.started = self.running = True
            self.run_texts = []
            return step
        if not self.started:
            # A leftover compaction_end of an earlier overflow recovery (and anything else
            # printed before our agent_start) is not part of this turn.
            return step
        handler = getattr(self, f"_on_{kind}", None)
        if handler is not None:
            handler(obj, step)
        return step

    def _on_response(self, obj: dict[str, Any], step: Step) -> None:
        rid = obj.get("id")
        if rid == self.prompt_id and obj.get("command", "prompt") == "prompt" and not self.accepted:
            if obj.get("success") is True:
                self.accepted = True
            else:
                step.rejected = as_str(obj.get("error")) or "prompt rejected"
            return
        if isinstance(rid, str) and rid in self.barrier_ids:
            self.barrier_outstanding = False
            if obj.get("success") is not True:
                return
            data = as_dict(obj.get("data"))
            busy = data.get("isStreaming") is not False or data.get("isCompacting") is not False
            if not self.started or self.last_end is None or self.running or self.compacting or busy:
                return  # something is still coming: the next agent_end / compaction_end re-arms
            self._flush_error(step, will_retry=False)
            step.settlement = self._settle(data)
            if step.settlement is None:
                step.no_evidence = "agent_end carried no assistant message (no stopReason to settle on)"

    def _on_message_update(self, obj: dict[str, Any], step: Step) -> None:
        ev = as_dict(obj.get("assistantMessageEvent"))
        # message_update.message / .partial are mutated objects, not snapshots: only `delta` is reliable.
        if ev.get("type") == "text_delta" and isinstance(ev.get("delta"), str) and ev["delta"]:
            self.streamed.append(ev["delta"])
            step.events.append(TextDelta(text=ev["delta"], raw=obj))

    def _on_message_end(self, obj: dict[str, Any], step: Step) -> None:
        msg = as_dict(obj.get("message"))
        if msg.get("role") != "assistant":
            return
        self.assistant_ended = True
        self.final_message = msg
        text = message_text(msg)
        if text and msg.get("stopReason") != "error":
            self.run_texts.append(text)
        if msg.get("stopReason") == "error":
            self.pending_error = obj

    def _on_tool_execution_start(self, obj: dict[str, Any], step: Step) -> None:
        step.events.append(ToolStarted(call_id=as_str(obj.get("toolCallId")) or "",
                                       tool=as_str(obj.get("toolName")) or "", input=obj.get("args"), raw=obj))

    def _on_tool_execution_end(self, obj: dict[str, Any], step: Step) -> None:
        step.events.append(ToolFinished(call_id=as_str(obj.get("toolCallId")) or "",
                                        is_error=obj.get("isError") is True, output=tool_output(obj.get("result")),
                                        raw=obj))

    def _on_agent_end(self, obj: dict[str, Any], step: Step) -> None:
        self.running = False
        self.last_end = obj
        self._arm(step)

    def _on_auto_retry_start(self, obj: dict[str, Any], step: Step) -> None:
        self.running = True  # a retry sleep, then a new agent_start … agent_end
        self.retries += 1
        self._flush_error(step, will_retry=True)
        attempt = obj.get("attempt")
        detail = as_str(obj.get("errorMessage"))
        step.events.append(RetryNotice(attempt=attempt if isinstance(attempt, int) else None,
                                       status=http_status(detail), detail=detail, raw=obj))

    def _on_auto_retry_end(self, obj: dict[str, Any], step: Step) -> None:
        if obj.get("success") is True:
            return  # printed mid-run, before that run's agent_end
        # Retries exhausted (after the final agent_end) or cancelled during the sleep
        # (abort/abort_retry: no further agent_end comes) — either way nothing more runs.
        self.running = False
        if as_str(obj.get("finalError")) == "Retry cancelled":
            self.retry_cancelled = True
        step.events.append(Notice(name="retry_end", detail=as_str(obj.get("finalError")), raw=obj))
        if self.last_end is not None:
            self._arm(step)

    def _on_compaction_start(self, obj: dict[str, Any], step: Step) -> None:
        self.compacting = True
        self.compacted = True
        self._flush_error(step, will_retry=as_str(obj.get("reason")) == "overflow")
        step.events.append(Notice(name="compaction", detail=as_str(obj.get("reason")), raw=obj))

    def _on_compaction_end(self, obj: dict[str, Any], step: Step) -> None:
        self.compacting = False
        if obj.get("willRetry") is True:
            self.running = True
            return
        if as_str(obj.get("errorMessage")):
            step.events.append(Notice(name="compaction_failed", detail=obj["errorMessage"], raw=obj))
        if self.last_end is not None:
            self._arm(step)

    # ------------------------------------------------------------------ helpers

    def _arm(self, step: Step) -> None:
        """Ask for a barrier unless one is already on its way (its answer is judged on arrival)."""
        if not self.barrier_outstanding:
            step.send_barrier = True

    def _flush_error(self, step: Step, *, will_retry: bool) -> None:
        if self.pending_error is None:
            return
        msg = as_dict(self.pending_error.get("message"))
        step.events.append(ErrorNotice(message=as_str(msg.get("errorMessage")) or "error", will_retry=will_retry,
                                       raw=self.pending_error))
        self.pending_error = None

    def final_assistant(self) -> dict[str, Any] | None:
        """The message that decides the outcome: the last assistant of the last agent_end
        (pi 0.73.1 can end a run with no assistant message_end at all, e.g. when the API key
        cannot be resolved), else the last assistant message_end."""
        found = last_assistant(as_dict(self.last_end).get("messages"))
        return found if found is not None else self.final_message

    def _settle(self, state: dict[str, Any]) -> Settlement | None:
        msg = self.final_assistant()
        raw = [self.last_end] if self.last_end is not None else []
        observed = state_locator(state)
        if msg is None:
            return None  # agent_end without any assistant message: no evidence either way
        stop = as_str(msg.get("stopReason"))
        error = as_str(msg.get("errorMessage"))
        text = TEXT_JOINER.join(self.run_texts)
        if stop in ("stop", "toolUse"):
            return Settlement(evidence=EVIDENCE, is_error=False, observed_locator=observed, assistant_text=text,
                              compacted=self.compacted, raw=raw)
        aborted = self.aborted and (stop in ("error", "aborted") or self.retry_cancelled)
        reason = failure_reason(stop, error, aborted=aborted)
        detail = error or (f"stopReason={stop}" if stop else "no stopReason")
        if self.retry_cancelled and "Retry cancelled" not in detail:
            detail = f"{detail} (retry cancelled)"
        return Settlement(evidence=EVIDENCE, is_error=True, reason=reason, detail=detail, observed_locator=observed,
                          assistant_text=text, compacted=self.compacted, raw=raw)


class PiTurnStart(TurnStart):
    prompt_id: str  # barrier and abort ids derive from it


class PiTracker(Tracker):
    """:class:`PiTurn` behind the template's tracker interface."""

    def __init__(self, start: PiTurnStart) -> None:
        self.start = start
        self.turn = PiTurn(prompt_id=start.prompt_id)
        self._barriers = 0
        self._aborts = 0

    def opening(self, message: str) -> list[dict[str, Any]]:
        # The message goes out byte for byte: json.dumps(ensure_ascii=False) escapes only what
        # JSON requires, and LF framing is safe because "\n" inside the text is escaped.
        return [{"id": self.start.prompt_id, "type": "prompt", "message": message}]

    def feed(self, obj: dict[str, Any]) -> TurnStep:
        step = self.turn.feed(obj)
        out = TurnStep(events=step.events)
        if step.rejected is not None:
            out.outcome = NotSettled(reason=NotSettledReason.COMMAND_REJECTED, detail=step.rejected)
        elif step.no_evidence is not None:
            out.outcome = NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail=step.no_evidence,
                                     assistant_text=self.partial_text())
        elif step.settlement is not None:
            out.outcome = step.settlement
        elif step.send_barrier:
            self._barriers += 1
            barrier = f"{self.start.prompt_id}.b{self._barriers}"
            self.turn.barrier_sent(barrier)
            out.send.append({"id": barrier, "type": "get_state"})
        return out

    def interrupt(self) -> list[dict[str, Any]]:
        # pi then ends the run (stopReason "aborted", or the cancelled retry) and the barrier settles it
        self.turn.aborted = True
        self._aborts += 1
        return [{"id": f"{self.start.prompt_id}.a{self._aborts}", "type": "abort"}]

    def partial_text(self) -> str:
        return self.turn.streamed_text

    def end_of_stream(self, diagnostics: str) -> NotSettled:
        tail = diagnostics.strip().splitlines()[-5:]
        return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED,
                          detail="stream ended during the turn" + (f": {' | '.join(tail)}" if tail else ""),
                          assistant_text=self.partial_text())
