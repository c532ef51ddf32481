"""The inspector's diagnosis over hand-built receipts: every conclusion, the fixed order of
the steps, and the terminal rendering (including a wire gap, before the proxy exists)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from runner.diagnosis import Diagnosis, Evidence, WireVerdict, diagnose, render_text, wire_of
from runner.native_probe import NativeFile, NativeState, parse_listing
from state.receipts import Receipt
from runner.timeline import Turn
from state.records import MemberRecord, SandboxRecord, SandboxState, SavedLocator

T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
LOC = "0199aaaa-1111-7000-8000-000000000001"
OTHER = "0199bbbb-2222-7000-8000-000000000002"
CONTAINER = "c0ffee" * 10 + "abcd"


def receipt(status: str | None, outcome: str, *, reason: str | None = None, before: str | None = LOC,
            after: str | None = LOC, evidence: str | None = "result", is_error: bool | None = False,
            text: str = "ok", detail: str | None = None) -> Receipt:
    return Receipt(job_id="job-1", user_id="u1", chat_id="c1", member_id="m1", runtime="codex",
                   context_status=status, outcome=outcome, reason=reason, locator_before=before, locator_after=after,
                   settlement={"evidence": evidence, "is_error": is_error, "detail": detail}, assistant_text=text,
                   sandbox={"container_id": CONTAINER, "image_id": "sha256:" + "ab" * 32, "helper_version": "4"},
                   cli_version="0.171.0", timings_ms={"sandbox": 10, "process": 200, "turn": 900, "total": 1200},
                   started_at=T0, finished_at=T0)


def member(**kw: Any) -> MemberRecord:
    base = {"user_id": "u1", "chat_id": "c1", "member_id": "m1", "runtime": "codex",
            "locator": SavedLocator(id=LOC), "settled_turns": 2, "home_member_id": "m1",
            "created_at": T0, "updated_at": T0}
    return MemberRecord(**(base | kw))


def sandbox(state: SandboxState = SandboxState.RUNNING, lost_reason: str | None = None,
            volume: str | None = None) -> SandboxRecord:
    return SandboxRecord(user_id="u1", chat_id="c1", container_id=CONTAINER, container_name="ca-u1-c1",
                         image_id="sha256:" + "ab" * 32, data_root_id="dr", host_id="host-a", state=state,
                         lost_reason=lost_reason, created_at=T0, last_used_at=T0, volume_name=volume,
                         volume_id=None if volume is None else "v" * 32)


def evidence(r: Receipt | None, *, wire: dict[str, Any] | None = None, m: MemberRecord | None = None,
             sb: SandboxRecord | None = None, native: NativeState | None = None) -> Evidence:
    turn = Turn(index=3, job_id="job-1", member_id="m1", state="done" if r else "running", started_at=T0, receipt=r)
    return Evidence(user_id="u1", chat_id="c1", turn=turn, host_id="host-a",
                    wire=WireVerdict.model_validate(wire) if wire else None, history=[r] if r else [],
                    member=m or member(), sandbox=sb or sandbox(), native=native)


GAP = {"requests": 2, "side_requests": 1, "history": "gap",
       "first_difference": {"index": 3, "role": "assistant", "expected_digest": "e" * 64, "observed_digest": "f" * 64}}

# (case, evidence, kind, conclusion)
CASES = [
    ("running", evidence(None), "running", "the turn is still running: no receipt yet"),
    ("lost container", evidence(receipt("LOST", "refused", reason="container_missing", evidence=None),
                                sb=sandbox(SandboxState.LOST, "container_missing")),
     "lost", "session LOST (container_missing): the native state is gone"),
    ("lost volume", evidence(receipt("LOST", "refused", reason="volume_missing", evidence=None),
                             sb=sandbox(SandboxState.LOST, "volume_missing")),
     "lost", "session LOST (volume_missing): the chat's state volume is gone, and the native state with it"),
    ("upgrade incompatible", evidence(receipt("LOST", "refused", reason="upgrade_incompatible", evidence=None)),
     "lost", "session LOST (upgrade_incompatible): after an image upgrade the new CLI could not confirm the "
     "saved session"),
    ("lost native state", evidence(receipt("LOST", "refused", reason="native_state_missing", evidence=None)),
     "lost", "session LOST (native_state_missing): the CLI's native session state is gone"),
    ("lost handshake", evidence(receipt("LOST", "refused", reason="locator_mismatch", evidence=None)),
     "lost", "session LOST (locator_mismatch): the resume handshake reported another session"),
    ("lost locator", evidence(receipt("LOST", "refused", reason="member_locator_missing", evidence=None, before=None,
                                      after=None), m=member(locator=None)),
     "lost", "session LOST (member_locator_missing): the member has settled turns but no saved locator"),
    ("previously lost", evidence(receipt("LOST", "refused", reason="previously_lost", evidence=None),
                                 m=member(lost_reason="data_root_changed")),
     "lost", "session LOST (previously_lost ← data_root_changed): the Docker data root is not the one the "
             "sandbox was created in"),
    ("refused locator", evidence(receipt("LIVE", "refused", reason="locator_mismatch", evidence=None)),
     "refused", "refused (locator_mismatch): the job named a locator that is not the member's saved one; "
                "nothing ran and the member is unchanged"),
    ("identity mismatch", evidence(receipt("RESTORED", "failed", reason="identity_mismatch", after=LOC,
                                           detail=f"expected {LOC}, CLI reported {OTHER}")),
     "identity_mismatch", "identity mismatch at settlement: the CLI reported another session; the saved locator "
                          "is unchanged"),
    ("wire gap", evidence(receipt("RESTORED", "succeeded"), wire=GAP),
     "wire_gap", "wire gap at message 3 (assistant): the model was not sent its history"),
    ("compacted", evidence(receipt("LIVE", "succeeded"), wire=GAP | {"history": "compacted"}),
     "compacted", "history compacted by the CLI at message 3 (assistant): a native summary, not a supervisor loss"),
    ("not settled", evidence(receipt("LIVE", "not_settled", reason="timeout", evidence=None, is_error=None)),
     "not_settled", "turn not settled (timeout): the saved locator is unchanged"),
    ("model error", evidence(receipt("LIVE", "failed", reason="rate_limited", is_error=True),
                             wire={"requests": 1, "side_requests": 0, "history": "complete"}),
     "model_error", "the model call failed (rate_limited): the session is intact"),
    ("complete", evidence(receipt("RESTORED", "succeeded"), wire={"requests": 1, "side_requests": 0,
                                                                  "history": "complete"}),
     "complete", "history complete on the wire: a model claim, not a loss"),
    ("new with wire", evidence(receipt("NEW", "succeeded", before=None), wire={"requests": 1, "history": "new"},
                               m=member(settled_turns=1)),
     "new", "first turn of the member: there was no earlier history to send"),
    ("new fork, no wire", evidence(receipt("NEW", "succeeded", before=None), m=member(forked_from="m0")),
     "new", "first turn of a fork: there was no earlier history to send"),
    ("no request", evidence(receipt("LIVE", "succeeded"), wire={"requests": 0, "side_requests": 0,
                                                                "history": "none"}),
     "no_request", "no conversational request reached the proxy"),
    ("no wire on this host", evidence(receipt("RESTORED", "succeeded")),
     "unverified", f"session RESTORED on {LOC}; the wire verdict is not available, so what the model was sent "
                   "is unverified"),
]


@pytest.mark.parametrize(("case", "ev", "kind", "conclusion"), CASES, ids=[c[0] for c in CASES])
def test_every_conclusion(case, ev, kind, conclusion) -> None:
    d = diagnose(ev)
    assert (d.kind, d.conclusion) == (kind, conclusion)
    names = [s.name for s in d.steps]
    assert names == (["route"] if kind == "running" else ["route", "identity", "native_state", "request"])


def test_the_problem_sits_in_the_step_its_reason_belongs_to() -> None:
    def verdicts(ev: Evidence) -> dict[str, str]:
        return {s.name: s.verdict for s in diagnose(ev).steps}

    lost_route = evidence(receipt("LOST", "refused", reason="container_missing", evidence=None),
                          sb=sandbox(SandboxState.LOST, "container_missing"))
    assert verdicts(lost_route) == {"route": "problem", "identity": "unknown", "native_state": "unknown",
                                    "request": "unknown"}
    lost_native = evidence(receipt("LOST", "refused", reason="native_state_missing", evidence=None))
    assert verdicts(lost_native)["route"] == "ok" and verdicts(lost_native)["native_state"] == "problem"
    lost_identity = evidence(receipt("LOST", "refused", reason="locator_mismatch", evidence=None))
    assert verdicts(lost_identity)["identity"] == "problem"
    gap = evidence(receipt("RESTORED", "succeeded"), wire=GAP)
    assert verdicts(gap) == {"route": "ok", "identity": "ok", "native_state": "unknown", "request": "problem"}


def test_native_state_present_and_missing_now() -> None:
    files = [NativeFile(path="/home/agent/members/x/home/.codex/sessions/2025/01/02/rollout-a-" + LOC + ".jsonl",
                        size=4096)]
    present = NativeState(checked=True, present=True, files=files, home_files=7, home_bytes=9000)
    step = diagnose(evidence(receipt("LIVE", "succeeded"), native=present)).steps[2]
    assert (step.verdict, step.summary) == ("ok", "present now: 1 session file(s), 4096 bytes")
    assert [(f.label, f.value) for f in step.facts] == [
        ("saved locator", LOC), ("settled turns", "2"), ("session file", f"{files[0].path} (4096 bytes)"),
        ("member home", "7 files, 9000 bytes")]
    gone = NativeState(checked=True, present=False, home_files=0, home_bytes=0)
    step = diagnose(evidence(receipt("LIVE", "succeeded"), native=gone)).steps[2]
    assert (step.verdict, step.summary) == ("problem", "the session files are missing now: a resume would be LOST")
    stopped = NativeState(checked=False, why="sandbox stopped: inspect does not start it")
    step = diagnose(evidence(receipt("LIVE", "succeeded"), native=stopped)).steps[2]
    assert (step.verdict, step.summary) == ("unknown", "not checked: sandbox stopped: inspect does not start it")


def test_a_gap_renders_index_role_and_digests_and_text_only_when_captured() -> None:
    d = diagnose(evidence(receipt("RESTORED", "succeeded"), wire=GAP))
    text = render_text(d)
    assert text.splitlines()[0] == "inspect u1/c1 turn 3 · job job-1 · member m1 (codex)"
    assert text.splitlines()[1] == "status RESTORED · outcome succeeded"
    assert "4. Request — problem: gap at message 3 (assistant): the model was not sent its history" in text
    assert f"   expected digest   {'e' * 64}" in text and f"   observed digest   {'f' * 64}" in text
    assert "   wire              gap · 2 request(s), 1 side" in text
    assert "text" not in " ".join(f.label for f in d.steps[3].facts)
    assert text.splitlines()[-1] == "conclusion: wire gap at message 3 (assistant): the model was not sent its history"
    captured = GAP | {"first_difference": GAP["first_difference"] | {"expected_text": "I said blue",
                                                                      "observed_text": "I said red"}}
    facts = {f.label: f.value for f in diagnose(evidence(receipt("RESTORED", "succeeded"), wire=captured)).steps[3].facts}
    assert (facts["expected text"], facts["observed text"]) == ("I said blue", "I said red")


def test_steps_come_in_the_fixed_order_in_the_terminal() -> None:
    text = render_text(diagnose(evidence(receipt("RESTORED", "succeeded"))))
    heads = [line.split(" — ")[0] for line in text.splitlines() if line[:2] in ("1.", "2.", "3.", "4.")]
    assert heads == ["1. Route", "2. Session identity", "3. Native state", "4. Request"]
    assert "   volume            not available" in text
    assert "   wire     not available" in text


def test_the_route_names_the_chats_state_volume() -> None:
    d = diagnose(evidence(receipt("RESTORED", "succeeded"), sb=sandbox(volume="ca-u1-c1-home")))
    assert {f.label: f.value for f in d.steps[0].facts}["volume"] == "ca-u1-c1-home"


def test_the_diagnosis_round_trips_as_json() -> None:
    d = diagnose(evidence(receipt("LOST", "refused", reason="container_missing", evidence=None)))
    assert Diagnosis.model_validate_json(d.model_dump_json()) == d


def test_wire_of_reads_a_receipt_that_has_one_and_not_one_that_has_none() -> None:
    assert wire_of(receipt("LIVE", "succeeded")) is None
    assert wire_of({"wire": None}) is None
    w = wire_of({"wire": GAP})
    assert w is not None and (w.history, w.first_difference.index, w.first_difference.role) == ("gap", 3, "assistant")


def test_native_listing_parse() -> None:
    out = "home 12 34567\nfile 4096 /a/b/rollout-x.jsonl\nfile 10 /a/b/c d.jsonl\njunk\n"
    assert parse_listing(out) == (12, 34567, [NativeFile(path="/a/b/rollout-x.jsonl", size=4096),
                                              NativeFile(path="/a/b/c d.jsonl", size=10)])
