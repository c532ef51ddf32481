"""The inspector's diagnosis of one turn (SPEC section 17), shared by the
``/inspect`` route, the operator page and ``cloud-agent inspect``.

The order is fixed — route (host, sandbox, volume), session identity (locator chain,
handshake and settlement evidence), native state (present, size), request (the wire
verdict) — because only the last step tells a model's false "I have no history" claim
from a real loss, and each step is meaningful only when the ones before it hold. The
one-line conclusion names the first thing that broke, or, when nothing did, what the wire
says the model was sent. Where a fact does not exist on this host (the wire verdict,
the volume of a sandbox made before state volumes) the diagnosis says "not available"; it never guesses.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from runner.native_probe import NativeState
from state.receipts import ContextStatus, Outcome, Receipt
from runner.timeline import Turn
from state.records import MemberRecord, SandboxRecord

NOT_AVAILABLE = "not available"

History = Literal["new", "complete", "gap", "compacted", "none"]
Verdict = Literal["ok", "problem", "unknown"]
Kind = Literal["running", "lost", "refused", "identity_mismatch", "wire_gap", "compacted", "not_settled",
               "model_error", "complete", "new", "no_request", "unverified"]

# Why a turn was refused or lost, by the step of the diagnosis the reason belongs to, with
# the words the conclusion uses.
ROUTE_REASONS = {
    "container_missing": "the native state is gone",  # receipts from before state volumes
    "volume_missing": "the chat's state volume is gone, and the native state with it",
    "volume_mismatch": "the chat's state volume is not the one recorded",
    "migration_impossible": "the sandbox was made before state volumes and its container, which held the "
                            "native state, is gone",
    "container_replaced": "the chat's container was replaced",
    "labels_mismatch": "the container's identity labels name another chat",
    "data_root_changed": "the Docker data root is not the one the sandbox was created in",
    "sandbox_unrecorded": "a container exists that the store never recorded",
    "wrong_host": "the chat's sandbox belongs to another host",
    "host_gone": "the chat's host is gone",
    "retention_expired": "the sandbox was removed after the retention period",
    "image_unsupported": "the configured image does not carry the pinned versions",
}
IDENTITY_REASONS = {
    "locator_mismatch": "the resume handshake reported another session",
    "member_locator_missing": "the member has settled turns but no saved locator",
    "identity_mismatch": "the CLI reported another session at settlement",
    "helper_version": "the in-sandbox helper is not the pinned version",
    "runtime_mismatch": "the job names another runtime than the member's",
}
NATIVE_REASONS = {
    "native_state_missing": "the CLI's native session state is gone",
    "upgrade_incompatible": "after an image upgrade the new CLI could not confirm the saved session",
}
# A job that names a locator other than the saved one is refused without condemning the member.
REFUSAL_WORDS = {
    "locator_mismatch": "the job named a locator that is not the member's saved one",
    "runtime_mismatch": "the job names another runtime than the member's",
}


class FirstDifference(BaseModel):
    """Where the turn's request first differs from the conversation the model saw before."""

    model_config = ConfigDict(extra="allow")

    index: int
    role: str
    expected_digest: str | None = None
    observed_digest: str | None = None
    expected_text: str | None = Field(default=None, description="only with wire capture on")
    observed_text: str | None = Field(default=None, description="only with wire capture on")


class WireVerdict(BaseModel):
    """The receipt's ``wire`` field (SPEC section 12), read as far as the inspector needs it."""

    model_config = ConfigDict(extra="allow")

    requests: int | None = None
    side_requests: int | None = None
    history: History
    first_difference: FirstDifference | None = None


def wire_of(receipt: Receipt | dict[str, Any] | None) -> WireVerdict | None:
    """The receipt's wire verdict, or None on a host (or a receipt) that has none."""
    if receipt is None:
        return None
    raw = receipt.get("wire") if isinstance(receipt, dict) else getattr(receipt, "wire", None)
    if raw is None:
        return None
    return WireVerdict.model_validate(raw.model_dump(mode="json") if isinstance(raw, BaseModel) else raw)


class Fact(BaseModel):
    label: str
    value: str


class Step(BaseModel):
    name: Literal["route", "identity", "native_state", "request"]
    title: str
    verdict: Verdict
    summary: str
    facts: list[Fact] = Field(default_factory=list)


class Diagnosis(BaseModel):
    user_id: str
    chat_id: str
    turn: int = Field(description="the diagnosed turn's 1-based index in the chat's timeline")
    job_id: str
    member_id: str
    runtime: str | None
    context_status: ContextStatus | None
    outcome: Outcome | None
    reason: str | None
    steps: list[Step]
    kind: Kind
    conclusion: str


@dataclass
class Evidence:
    """Everything the diagnosis reads; the route gathers it, unit tests build it by hand."""

    user_id: str
    chat_id: str
    turn: Turn
    host_id: str
    wire: WireVerdict | None = None
    history: list[Receipt] = field(default_factory=list)  # the member's receipts up to this turn
    member: MemberRecord | None = None
    sandbox: SandboxRecord | None = None
    native: NativeState | None = None


def short(value: str | None, n: int = 12) -> str:
    if not value:
        return "∅"
    return value if len(value) <= n else value[:n] + "…"


def root_reason(receipt: Receipt, member: MemberRecord | None) -> str | None:
    """A refusal as ``previously_lost`` stands for the reason the member was first lost."""
    if receipt.reason == "previously_lost" and member is not None and member.lost_reason:
        return member.lost_reason
    return receipt.reason


# -- the four steps ---------------------------------------------------------------------------------


def route_step(ev: Evidence, receipt: Receipt | None, reason: str | None) -> Step:
    sb = ev.sandbox
    facts = [Fact(label="host", value=f"{ev.host_id} (this daemon)")]
    if sb is not None and sb.host_id != ev.host_id:
        facts.append(Fact(label="recorded host", value=sb.host_id))
    if sb is None:
        facts.append(Fact(label="sandbox", value="none recorded"))
    else:
        state = sb.state.value + (f" ({sb.lost_reason})" if sb.lost_reason else "")
        facts.append(Fact(label="sandbox", value=f"{sb.container_name} {short(sb.container_id)} {state}"))
    served = receipt.sandbox.container_id if receipt else None
    facts.append(Fact(label="turn's container", value=short(served) if served else "none (refused before)"))
    if receipt and receipt.sandbox.image_id:
        facts.append(Fact(label="image", value=short(receipt.sandbox.image_id, 19)))
    volume = sb.volume_name if sb is not None else None
    facts.append(Fact(label="volume", value=str(volume) if volume else NOT_AVAILABLE))
    if receipt is not None and reason in ROUTE_REASONS and receipt.context_status == ContextStatus.LOST:
        return Step(name="route", title="Route", verdict="problem", facts=facts,
                    summary=f"{reason}: {ROUTE_REASONS[reason]}")
    if sb is None:
        return Step(name="route", title="Route", verdict="unknown", facts=facts, summary="no sandbox recorded")
    return Step(name="route", title="Route", verdict="ok", facts=facts,
                summary=f"served by {ev.host_id}, sandbox {sb.state.value}")


def locator_chain(history: list[Receipt]) -> str:
    links = [f"{r.context_status.value if r.context_status else '-'} "
             f"{short(r.locator_before, 8)}→{short(r.locator_after, 8)}" for r in history]
    return " · ".join(links) if links else NOT_AVAILABLE


def handshake_words(receipt: Receipt) -> str:
    status = receipt.context_status
    if receipt.outcome == Outcome.REFUSED:
        if receipt.reason == "locator_mismatch" and status == ContextStatus.LOST:
            return "the resume handshake reported another session: refused"
        return "refused before any CLI process ran"
    if status == ContextStatus.NEW:
        return f"new native session {receipt.locator_after or '∅'}"
    if status == ContextStatus.LIVE:
        return "the member's resident process (no new handshake)"
    if status == ContextStatus.RESTORED:
        return f"the resume handshake confirmed {receipt.locator_before}"
    return "no handshake finished"


def identity_step(ev: Evidence, receipt: Receipt, reason: str | None) -> Step:
    facts = [Fact(label="member", value=f"{ev.turn.member_id} ({receipt.runtime})"
                  + (f", forked from {ev.member.forked_from}" if ev.member and ev.member.forked_from else "")),
             Fact(label="locator", value=f"{receipt.locator_before or '∅'} → {receipt.locator_after or '∅'}"),
             Fact(label="locator chain", value=locator_chain(ev.history)),
             Fact(label="handshake", value=handshake_words(receipt))]
    s = receipt.settlement
    if s.evidence:
        facts.append(Fact(label="settlement", value=s.evidence + (" (is_error)" if s.is_error else "")))
    if s.detail:
        facts.append(Fact(label="detail", value=s.detail))
    lost = receipt.context_status == ContextStatus.LOST
    if reason in IDENTITY_REASONS and (lost or reason == "identity_mismatch"):
        return Step(name="identity", title="Session identity", verdict="problem", facts=facts,
                    summary=f"{reason}: {IDENTITY_REASONS[reason]}")
    if lost and reason in ROUTE_REASONS:
        return Step(name="identity", title="Session identity", verdict="unknown", facts=facts,
                    summary="not reached: the route failed first")
    if lost and reason in NATIVE_REASONS:
        return Step(name="identity", title="Session identity", verdict="unknown", facts=facts,
                    summary="the saved locator could not be resumed: its native state is gone")
    if receipt.outcome == Outcome.REFUSED and not lost and reason in REFUSAL_WORDS:
        return Step(name="identity", title="Session identity", verdict="ok", facts=facts,
                    summary=f"{reason}: {REFUSAL_WORDS[reason]}; the member is unchanged")
    if s.evidence and not s.is_error:
        return Step(name="identity", title="Session identity", verdict="ok", facts=facts,
                    summary=f"settled on {receipt.locator_after or '∅'} ({s.evidence})")
    if s.evidence:
        return Step(name="identity", title="Session identity", verdict="ok", facts=facts,
                    summary=f"settled with an error on {receipt.locator_after or '∅'}; the locator held")
    return Step(name="identity", title="Session identity", verdict="unknown", facts=facts,
                summary="no settlement evidence: the saved locator is unchanged")


def native_step(ev: Evidence, receipt: Receipt, reason: str | None) -> Step:
    m = ev.member
    facts = []
    if m is not None:
        saved = m.locator.id + (f" ({m.locator.path})" if m.locator and m.locator.path else "") if m.locator else "∅"
        facts += [Fact(label="saved locator", value=saved), Fact(label="settled turns", value=str(m.settled_turns))]
        if m.lost_reason:
            facts.append(Fact(label="member lost", value=m.lost_reason))
    n = ev.native
    if n is None or not n.checked:
        facts.append(Fact(label="now", value=f"not checked: {n.why}" if n and n.why else "not checked"))
    else:
        for f in n.files:
            facts.append(Fact(label="session file", value=f"{f.path} ({f.size} bytes)"))
        if n.present is False:
            facts.append(Fact(label="session files", value="none found" + (f" ({n.why})" if n.why else "")))
        if n.home_files is not None:
            facts.append(Fact(label="member home", value=f"{n.home_files} files, {n.home_bytes} bytes"))
    if reason in NATIVE_REASONS and receipt.context_status == ContextStatus.LOST:
        return Step(name="native_state", title="Native state", verdict="problem", facts=facts,
                    summary=f"{reason}: {NATIVE_REASONS[reason]}")
    if receipt.context_status == ContextStatus.LOST:
        return Step(name="native_state", title="Native state", verdict="unknown", facts=facts,
                    summary="not reached: an earlier step failed")
    if n is not None and n.checked and n.present is False and m is not None and m.settled_turns > 0:
        return Step(name="native_state", title="Native state", verdict="problem", facts=facts,
                    summary="the session files are missing now: a resume would be LOST")
    if n is not None and n.checked and n.present:
        size = sum(f.size for f in n.files)
        return Step(name="native_state", title="Native state", verdict="ok", facts=facts,
                    summary=f"present now: {len(n.files)} session file(s), {size} bytes")
    return Step(name="native_state", title="Native state", verdict="unknown", facts=facts,
                summary=f"not checked: {n.why}" if n and n.why else "not checked")


def request_step(ev: Evidence, receipt: Receipt) -> Step:
    w = ev.wire
    facts = [Fact(label="outcome", value=receipt.outcome.value + (f" ({receipt.reason})" if receipt.reason else "")),
             Fact(label="reply", value=f"{len(receipt.assistant_text)} characters")]
    if w is None:
        facts.insert(0, Fact(label="wire", value=NOT_AVAILABLE))
        return Step(name="request", title="Request", verdict="unknown", facts=facts,
                    summary=f"wire verdict {NOT_AVAILABLE}")
    counts = f"{w.requests if w.requests is not None else '?'} request(s), {w.side_requests or 0} side"
    facts.insert(0, Fact(label="wire", value=f"{w.history} · {counts}"))
    d = w.first_difference
    if d is not None:
        facts += [Fact(label="first difference", value=f"message {d.index} ({d.role})"),
                  Fact(label="expected digest", value=d.expected_digest or "∅ (absent)"),
                  Fact(label="observed digest", value=d.observed_digest or "∅ (absent)")]
        if d.expected_text is not None:
            facts.append(Fact(label="expected text", value=d.expected_text))
        if d.observed_text is not None:
            facts.append(Fact(label="observed text", value=d.observed_text))
    if w.history == "gap":
        where = f" at message {d.index} ({d.role})" if d else ""
        return Step(name="request", title="Request", verdict="problem", facts=facts,
                    summary=f"gap{where}: the model was not sent its history")
    summaries = {"complete": "the model was sent the whole history", "new": "a first turn: no history to send",
                 "compacted": "the CLI compacted its history (its own summary)",
                 "none": "no conversational request reached the proxy"}
    return Step(name="request", title="Request", verdict="ok", facts=facts, summary=summaries[w.history])


# -- the conclusion ---------------------------------------------------------------------------------


def conclude(ev: Evidence, receipt: Receipt, reason: str | None) -> tuple[Kind, str]:
    w = ev.wire
    status, outcome = receipt.context_status, receipt.outcome
    if status == ContextStatus.LOST:
        chain = f"{receipt.reason} ← {reason}" if reason != receipt.reason else str(reason)
        words = {**ROUTE_REASONS, **IDENTITY_REASONS, **NATIVE_REASONS}.get(reason or "", "the member is lost")
        return "lost", f"session LOST ({chain}): {words}"
    if outcome == Outcome.REFUSED:
        known = {**ROUTE_REASONS, **IDENTITY_REASONS, **NATIVE_REASONS, **REFUSAL_WORDS}
        words = known.get(reason or "", "refused before any CLI ran")
        return "refused", f"refused ({reason}): {words}; nothing ran and the member is unchanged"
    if reason == "identity_mismatch":
        return "identity_mismatch", ("identity mismatch at settlement: the CLI reported another session; "
                                     "the saved locator is unchanged")
    d = w.first_difference if w else None
    where = f" at message {d.index} ({d.role})" if d else ""
    if w is not None and w.history == "gap":
        return "wire_gap", f"wire gap{where}: the model was not sent its history"
    if w is not None and w.history == "compacted":
        return "compacted", f"history compacted by the CLI{where}: a native summary, not a supervisor loss"
    if outcome == Outcome.NOT_SETTLED:
        return "not_settled", f"turn not settled ({reason}): the saved locator is unchanged"
    if outcome == Outcome.FAILED:
        return "model_error", f"the model call failed ({reason}): the session is intact"
    if w is not None and w.history == "complete":
        return "complete", "history complete on the wire: a model claim, not a loss"
    if (w is not None and w.history == "new") or status == ContextStatus.NEW:
        fork = " of a fork" if ev.member is not None and ev.member.forked_from else " of the member"
        return "new", f"first turn{fork}: there was no earlier history to send"
    if w is not None and w.history == "none":
        return "no_request", "no conversational request reached the proxy"
    return "unverified", (f"session {status.value if status else '-'} on {receipt.locator_after or '∅'}; "
                          f"the wire verdict is {NOT_AVAILABLE}, so what the model was sent is unverified")


def diagnose(ev: Evidence) -> Diagnosis:
    turn = ev.turn
    receipt = turn.receipt
    head: dict[str, Any] = {"user_id": ev.user_id, "chat_id": ev.chat_id, "turn": turn.index, "job_id": turn.job_id,
                            "member_id": turn.member_id}
    if receipt is None:
        steps = [route_step(ev, None, None)]
        return Diagnosis(**head, runtime=ev.member.runtime if ev.member else None, context_status=None,
                         outcome=None, reason=None, steps=steps, kind="running",
                         conclusion="the turn is still running: no receipt yet")
    reason = root_reason(receipt, ev.member)
    steps = [route_step(ev, receipt, reason), identity_step(ev, receipt, reason), native_step(ev, receipt, reason),
             request_step(ev, receipt)]
    kind, conclusion = conclude(ev, receipt, reason)
    return Diagnosis(**head, runtime=receipt.runtime, context_status=receipt.context_status,
                     outcome=receipt.outcome, reason=receipt.reason, steps=steps, kind=kind, conclusion=conclusion)


# -- the terminal form --------------------------------------------------------------------------------


def render_text(d: Diagnosis) -> str:
    status = d.context_status.value if d.context_status else "-"
    outcome = d.outcome.value if d.outcome else "running"
    lines = [f"inspect {d.user_id}/{d.chat_id} turn {d.turn} · job {d.job_id} · member {d.member_id}"
             f" ({d.runtime or '?'})",
             f"status {status} · outcome {outcome}" + (f" · reason {d.reason}" if d.reason else ""), ""]
    for i, step in enumerate(d.steps, start=1):
        lines.append(f"{i}. {step.title} — {step.verdict}: {step.summary}")
        width = max((len(f.label) for f in step.facts), default=0)
        lines += [f"   {f.label:<{width}}  {f.value}" for f in step.facts]
    lines += ["", f"conclusion: {d.conclusion}"]
    return "\n".join(lines)
