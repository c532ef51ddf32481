"""What one turn's wire audit costs by the length of its member's history (a script, not a test).

    uv run python tests/bench/bench_history.py [-n 300]

Every request of a chat carries its whole history, so two steps of each turn are O(history):
the proxy's audit of the request (its body parsed, each text message's digest made: on the
proxy service's worker thread, beside the model's answer) and the judge (the turn's records
read back from the ledger and compared with the member's baseline: on the store's thread,
inside the commit's transaction, on the turn's path). For each history length (messages) this
prints both, p50 over ``-n`` runs, interleaved, so a version of the code can be compared with
another by running this in each tree in turn (issue 16: 2026-12-06, DigestEntry a dataclass).
``remembered`` is the same audit when the member's last request (two messages shorter) is in
the proxy's audit memo, as a follow-up's is (proxy.audit_memo), side by side with ``audit``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import UTC, datetime

from proxy import Baseline
from proxy.audit import audit_request
from proxy.audit_memo import AuditMemo
from proxy.routes import ROUTES
from runner.baseline_cache import BaselineCache
from runner.model_path import ModelPath
from state.receipts import Outcome, Receipt
from state.records import MemberRecord
from state.wire_ledger import WireSettleView
from tests.bench.bench_judge import BEFORE, C, M, U, hot, settle_view

ROUTE = next(r for r in ROUTES if r.name == "anthropic.messages")
MEMBER = ("chat", "member")


def text(i: int) -> str:
    return f"message {i}: " + "a sentence of an ordinary length, " * 4


def body_of(history: int) -> bytes:
    # alternating, the last one the user's: this turn's message
    messages = [{"role": "user" if (history - i) % 2 == 1 else "assistant",
                 "content": [{"type": "text", "text": text(i)}]} for i in range(history)]
    return json.dumps({"model": "m", "max_tokens": 64, "stream": True, "messages": messages}).encode()


def view_of(history: int) -> tuple[WireSettleView, Baseline]:
    """The member's baseline before this turn's request, and the request's record in the ledger."""
    digest = audit_request(body_of(history), None, ROUTE, capture=False).digest
    assert digest is not None and len(digest) == history
    before = Baseline(conversation=digest[:-2], reply=[digest[-2]])
    return settle_view(before, digest, path="/v1/messages", route=ROUTE.name, api="anthropic"), before


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=300, help="runs per step and history length")
    ap.add_argument("--messages", default="20,60,200,400,800", help="history lengths, comma-separated")
    args = ap.parse_args()
    mp = ModelPath.__new__(ModelPath)  # judge is pure: no store, proxy or settings needed
    now = datetime.now(UTC)
    receipt = Receipt(job_id="j2", user_id=U, chat_id=C, member_id=M, runtime="claude", context_status=None,
                      outcome=Outcome.SUCCEEDED, started_at=now, finished_at=now)
    member = MemberRecord(user_id=U, chat_id=C, member_id=M, runtime="claude", settled_turns=1, home_member_id=M,
                          created_at=now, updated_at=now)
    print(f"one turn's O(history) steps, p50 ms over {args.n} runs each")
    print(f"{'messages':>9} {'audit':>8} {'remembered':>11} {'judge':>8}")
    for history in (int(h) for h in args.messages.split(",")):
        raw = body_of(history)
        view, before = view_of(history)
        query, hot_view = hot(view, before)
        message = text(history - 1)
        times: dict[str, list[float]] = {"audit": [], "remembered": [], "judge": []}
        previous = body_of(history - 2)  # the member's last request: this one without its last two
        for i in range(args.n + 10):
            t = time.perf_counter()
            audit_request(raw, None, ROUTE, capture=False)
            t1 = time.perf_counter()
            memo = AuditMemo()
            audit_request(previous, None, ROUTE, capture=False, memo=memo, member=MEMBER)
            t2 = time.perf_counter()
            audited = audit_request(raw, None, ROUTE, capture=False, memo=memo, member=MEMBER)
            t3 = time.perf_counter()
            assert audited.remembered == history - 2
            mp.baselines = BaselineCache()
            mp.baselines.keep((U, C, M), view.expectation.baseline_json or "", before, BEFORE)  # this daemon's last commit
            t4 = time.perf_counter()
            wire, _ = mp.judge(receipt, member, query, hot_view, message=message, compaction=False, settled_index=2)
            t5 = time.perf_counter()
            assert wire.history == "complete", wire
            if i >= 10:  # warmed up
                times["audit"].append((t1 - t) * 1000)
                times["remembered"].append((t3 - t2) * 1000)
                times["judge"].append((t5 - t4) * 1000)
        print(f"{history:>9} " + " ".join(f"{statistics.median(times[k]):>{w}.3f}"
                                          for k, w in (("audit", 8), ("remembered", 11), ("judge", 8))))


if __name__ == "__main__":
    main()
