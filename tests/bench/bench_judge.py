"""A turn's wire verdict on the commit's path, with its member's baseline kept parsed by the
daemon that committed it and parsed from the store's text (a script, not a test).

    uv run python tests/bench/bench_judge.py [-n 400]

``ModelPath.judge`` runs inside the commit's transaction (SQLite: on the store's thread, the
write lock held), once per turn. It reads the job's records (each stored as its difference from
the member's previous record, proxy.stored_digest) and the member's last baseline (a reference
to its record). For each history length, the same turn is judged N times per arm, the arms
interleaved call by call: ``kept`` takes the baseline kept parsed (runner.baseline_cache, the
usual case: this daemon committed the member's previous turn), so the view reads no earlier
record; ``parsed`` reads the baseline's record back and rebuilds it (another host's turn, a
restart, a rolled-back commit). Prints p50 per arm and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime

from proxy import Baseline, DigestEntry, WireRecord
from proxy.records import ApiShape
from proxy.stored_digest import BaselineRef, as_difference
from runner.baseline_cache import BaselineCache
from runner.model_path import ModelPath
from state.receipts import Outcome, Receipt
from state.records import MemberRecord
from state.wire_ledger import (
    SettleQuery,
    WireExpectation,
    WireRecordRow,
    WireSettleView,
)

U, C, M = "u1", "c1", "m1"


def conversation(n: int) -> list[DigestEntry]:
    return [DigestEntry.text("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(n)]


BEFORE = "r0"  # the record of the member's previous turn, whose whole digest is the baseline's conversation


def view_of(history: int) -> tuple[WireSettleView, Baseline]:
    """The member's baseline after ``history`` messages, and this turn's one request on it."""
    before = Baseline(conversation=conversation(history - 1), reply=[DigestEntry.text("assistant", "reply")])
    return settle_view(before, [*before.expected, DigestEntry.text("user", "this turn")]), before


def record(digest: list[DigestEntry], reply: list[DigestEntry], *, path: str = "/v1/responses",
           route: str = "openai.responses", api: ApiShape = "responses") -> WireRecord:
    return WireRecord(seq=1, chat_key="k", member_key="mk", job_id="j2", started_at=datetime.now(UTC),
                      duration_ms=1.0, method="POST", path=path, route=route, api=api, kind="conversation",
                      side=False, status=200, bytes_in=1, bytes_out=1, digest=digest, reply=reply)


def settle_view(before: Baseline, digest: list[DigestEntry], **route: str) -> WireSettleView:
    """What the commit reads when it holds no earlier record (a restart): the member's
    ``before`` (a reference to its record, read back as an ancestor) and the turn's one
    request, whose conversation is ``digest``, as the ledger holds them. :func:`hot` is the
    same view for the daemon that committed ``before``."""
    earlier = record(before.conversation, before.reply, **route)  # type: ignore[arg-type]
    request = as_difference(record(digest, [DigestEntry.text("assistant", "this reply")], **route),  # type: ignore[arg-type]
                            BEFORE, before.conversation)
    assert request is not None
    rows = [WireRecordRow(record_id=rid, user_id=U, chat_id=C, member_id=M, job_id=job, ordinal=rid,
                          record_json=r.model_dump_json(), capture_json=None, created_at="",
                          digest_parent=r.digest_parent) for rid, job, r in ((BEFORE, "j1", earlier), ("r1", "j2", request))]
    ref = BaselineRef(record_id=BEFORE, reply=before.reply).model_dump_json()
    return WireSettleView([rows[1]], WireExpectation(True, ref, [], BEFORE), ancestors=[rows[0]])


def hot(view: WireSettleView, before: Baseline) -> tuple[SettleQuery, WireSettleView]:
    """The query and view of the daemon that committed ``before``: it holds its record whole."""
    return (SettleQuery(C, M, known={BEFORE: before.conversation}),
            WireSettleView(view.records, view.expectation))


def cold() -> SettleQuery:
    """The query of a daemon that holds no earlier record of the member (a restart)."""
    return SettleQuery(C, M)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=400, help="judgements per arm and history length")
    args = ap.parse_args()
    mp = ModelPath.__new__(ModelPath)  # judge is pure: no store, proxy or settings needed
    now = datetime.now(UTC)
    receipt = Receipt(job_id="j2", user_id=U, chat_id=C, member_id=M, runtime="codex", context_status=None,
                      outcome=Outcome.SUCCEEDED, started_at=now, finished_at=now)
    member = MemberRecord(user_id=U, chat_id=C, member_id=M, runtime="codex", settled_turns=1, home_member_id=M,
                          created_at=now, updated_at=now)
    print(f"ModelPath.judge, one request per turn, {args.n} judgements per arm (ms, p50)")
    print(f"{'history':>8} {'kept':>8} {'parsed':>8} {'kept/parsed':>12}")
    for history in (20, 60, 200, 600):
        view, before = view_of(history)
        text = view.expectation.baseline_json or ""
        hot_query, hot_view = hot(view, before)
        times: dict[str, list[float]] = {"kept": [], "parsed": []}
        for i in range(args.n * 2 + 20):
            arm = "kept" if i % 2 == 0 else "parsed"
            mp.baselines = BaselineCache()
            if arm == "kept":
                mp.baselines.keep((U, C, M), text, before, BEFORE)
            query, seen = (hot_query, hot_view) if arm == "kept" else (cold(), view)
            t = time.perf_counter()
            wire, _ = mp.judge(receipt, member, query, seen, message="this turn", compaction=False, settled_index=2)
            if i >= 20:  # warmed up
                times[arm].append((time.perf_counter() - t) * 1000)
            assert wire.history == "complete", wire
        kept, parsed = statistics.median(times["kept"]), statistics.median(times["parsed"])
        print(f"{history:>8} {kept:>8.3f} {parsed:>8.3f} {kept / parsed:>12.3f}")


if __name__ == "__main__":
    main()
