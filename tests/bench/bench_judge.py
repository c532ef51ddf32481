"""A turn's wire verdict on the commit's path, with its member's baseline kept parsed by the
daemon that committed it and parsed from the store's text (a script, not a test).

    uv run python tests/bench/bench_judge.py [-n 400]

``ModelPath.judge`` runs inside the commit's transaction (SQLite: on the store's thread, the
write lock held), once per turn. It reads the job's records and the member's last baseline,
both O(history). For each history length, the same view is judged N times per arm, the arms
interleaved call by call: ``kept`` takes the baseline kept parsed (runner.baseline_cache, the
usual case: this daemon committed the member's previous turn), ``parsed`` parses the stored
text (another host's turn, a restart, a rolled-back commit). Prints p50 per arm and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from datetime import UTC, datetime

from proxy import Baseline, DigestEntry, WireRecord
from proxy.records import ApiShape
from runner.baseline_cache import BaselineCache
from runner.model_path import ModelPath
from state.receipts import Outcome, Receipt
from state.records import MemberRecord
from state.wire_ledger import WireExpectation, WireRecordRow, WireSettleView

U, C, M = "u1", "c1", "m1"


def conversation(n: int) -> list[DigestEntry]:
    return [DigestEntry.text("user" if i % 2 == 0 else "assistant", f"message {i}") for i in range(n)]


def view_of(history: int) -> tuple[WireSettleView, Baseline]:
    """The member's baseline after ``history`` messages, and this turn's one request on it."""
    before = Baseline(conversation=conversation(history - 1), reply=[DigestEntry.text("assistant", "reply")])
    return settle_view(before, [*before.expected, DigestEntry.text("user", "this turn")]), before


def settle_view(before: Baseline, digest: list[DigestEntry], *, path: str = "/v1/responses",
                route: str = "openai.responses", api: ApiShape = "responses") -> WireSettleView:
    """What the commit reads: the member's ``before`` and the turn's one request, whose
    conversation is ``digest``, as the ledger holds them."""
    request = WireRecord(seq=1, chat_key="k", member_key="mk", job_id="j2", started_at=datetime.now(UTC),
                         duration_ms=1.0, method="POST", path=path, route=route, api=api, kind="conversation",
                         side=False, status=200, bytes_in=1, bytes_out=1, digest=digest,
                         reply=[DigestEntry.text("assistant", "this reply")])
    row = WireRecordRow(record_id="r1", user_id=U, chat_id=C, member_id=M, job_id="j2", ordinal="1",
                        record_json=request.model_dump_json(), capture_json=None, created_at="")
    return WireSettleView([row], WireExpectation(True, before.model_dump_json(), []))


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
        times: dict[str, list[float]] = {"kept": [], "parsed": []}
        for i in range(args.n * 2 + 20):
            arm = "kept" if i % 2 == 0 else "parsed"
            mp.baselines = BaselineCache()
            mp.baselines.keep((U, C, M), text if arm == "kept" else "another text", before)
            t = time.perf_counter()
            wire, _ = mp.judge(receipt, member, view, message="this turn", compaction=False, settled_index=2)
            if i >= 20:  # warmed up
                times[arm].append((time.perf_counter() - t) * 1000)
            assert wire.history == "complete", wire
        kept, parsed = statistics.median(times["kept"]), statistics.median(times["parsed"])
        print(f"{history:>8} {kept:>8.3f} {parsed:>8.3f} {kept / parsed:>12.3f}")


if __name__ == "__main__":
    main()
