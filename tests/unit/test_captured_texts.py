"""The inspector's first-difference texts come from the capture ledger only when they hash to
the digests the wire verdict names (runner/captured_texts.py)."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from typing import Any

import pytest

from proxy.digest import sha256_text
from runner.captured_texts import fill_captured_texts
from runner.diagnosis import WireVerdict
from state.receipts import Receipt
from state.store import Store
from state.wire_ledger import WireRecordRow

pytestmark = pytest.mark.anyio
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)
FIRST, CHANGED, REPLY = "remember the word heron", "remember the word crow!", "noted: heron"


def receipt(job_id: str) -> Receipt:
    return Receipt(job_id=job_id, user_id="u1", chat_id="c1", member_id="m1", runtime="codex",
                   context_status="LIVE", outcome="succeeded", locator_before="L1", locator_after="L1",
                   settlement={"evidence": "turn/completed"}, started_at=T0, finished_at=T0)


def capture(request: list[tuple[str, str]], reply: list[tuple[str, str]]) -> str:
    return json.dumps({"request": [{"role": r, "text": t} for r, t in request],
                       "reply": [{"role": r, "text": t} for r, t in reply]})


async def put(store: Store, job: str, n: int, capture_json: str | None) -> None:
    await store.put_wire_record(WireRecordRow(f"r-{job}-{n}", "u1", "c1", "m1", job, f"{n:04d}", "{}",
                                              capture_json, T0.isoformat()))


def gap() -> WireVerdict:
    return WireVerdict.model_validate({"requests": 1, "side_requests": 0, "history": "gap", "first_difference": {
        "index": 0, "role": "user", "expected_digest": sha256_text(FIRST), "observed_digest": sha256_text(CHANGED)}})


@pytest.fixture
async def store(tmp_path):
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


async def test_both_texts_are_found_where_the_capture_proves_them(store) -> None:
    await put(store, "j1", 1, capture([("user", FIRST)], [("assistant", REPLY)]))
    await put(store, "j2", 2, capture([("user", CHANGED), ("assistant", REPLY), ("user", "which word?")], []))
    wire = gap()
    await fill_captured_texts(store, "u1", "c1", "j2", wire, [receipt("j1"), receipt("j2")])
    assert wire.first_difference is not None
    assert (wire.first_difference.expected_text, wire.first_difference.observed_text) == (FIRST, CHANGED)


async def test_without_capture_or_with_texts_of_other_digests_nothing_is_shown(store) -> None:
    await put(store, "j1", 1, None)  # capture off (or purged)
    await put(store, "j2", 2, capture([("user", "an unrelated text")], []))
    wire = gap()
    await fill_captured_texts(store, "u1", "c1", "j2", wire, [receipt("j1"), receipt("j2")])
    assert wire.first_difference is not None
    assert (wire.first_difference.expected_text, wire.first_difference.observed_text) == (None, None)


async def test_another_chats_capture_is_never_read(store) -> None:
    await store.put_wire_record(WireRecordRow("r-x", "u2", "c1", "m1", "j2", "0001", "{}",
                                              capture([("user", CHANGED)], [("assistant", FIRST)]), T0.isoformat()))
    wire = gap()
    await fill_captured_texts(store, "u1", "c1", "j2", wire, [receipt("j1"), receipt("j2")])
    assert wire.first_difference is not None
    assert (wire.first_difference.expected_text, wire.first_difference.observed_text) == (None, None)


async def test_a_verdict_without_a_difference_reads_nothing(store) -> None:
    class NoReads:
        async def wire_records_of_job(self, *args: object) -> list[WireRecordRow]:
            raise AssertionError("no first difference: the ledger is not read")

    wire = WireVerdict.model_validate({"requests": 1, "side_requests": 0, "history": "complete"})
    await fill_captured_texts(NoReads(), "u1", "c1", "j2", wire, [receipt("j2")])  # type: ignore[arg-type]
    await fill_captured_texts(NoReads(), "u1", "c1", "j2", None, [])  # type: ignore[arg-type]


def chain(turns: int) -> list[WireRecordRow]:
    """A member's requests as the sink stores them (a difference from the previous one each):
    turn i (1-based) asked q<i> after the replies r<i-1>, and captured only its new texts."""
    out = []
    for i in range(1, turns + 1):
        tail = [("user", "q1")] if i == 1 else [("assistant", f"r{i - 1}"), ("user", f"q{i}")]
        out.append(WireRecordRow(f"r{i}", "u1", "c1", "m1", f"j{i}", f"{i:04d}", "{}",
                                 capture(tail, [("assistant", f"r{i}")]), T0.isoformat(),
                                 digest_parent=f"r{i - 1}" if i > 1 else None))
    return out


async def test_a_text_only_an_old_parent_record_captured_is_found_along_the_chain(store) -> None:
    # the 12th turn's request rewrote q2 (its record shares 2 entries with the 11th's, and
    # captured the rest); q2 itself is captured only by the 2nd turn's record, which is more than
    # EARLIER_TURNS turns back: the chain of parents reaches it
    rows = chain(11)
    rewritten = [("user", "q2 changed"), ("assistant", "r2"),
                 *[m for i in range(3, 12) for m in (("user", f"q{i}"), ("assistant", f"r{i}"))], ("user", "q12")]
    rows.append(WireRecordRow("r12", "u1", "c1", "m1", "j12", "0012", "{}", capture(rewritten, []),
                              T0.isoformat(), digest_parent="r11"))
    for row in rows:
        assert await store.put_wire_record(row)
    history = [receipt(f"j{i}") for i in range(1, 13)]
    reads: list[list[str]] = []
    ancestors = store.wire_ancestors

    async def counted(user_id: str, chat_id: str, seeds: list[str], **kw: Any) -> list[WireRecordRow]:
        reads.append(seeds)
        return await ancestors(user_id, chat_id, seeds, **kw)

    store.wire_ancestors = counted  # type: ignore[method-assign]
    wire = WireVerdict.model_validate({"requests": 1, "side_requests": 0, "history": "gap", "first_difference": {
        "index": 2, "role": "user", "expected_digest": sha256_text("q2"), "observed_digest": sha256_text("q2 changed")}})
    await fill_captured_texts(store, "u1", "c1", "j12", wire, history)
    assert wire.first_difference is not None
    assert (wire.first_difference.expected_text, wire.first_difference.observed_text) == ("q2", "q2 changed")
    assert reads == [["r3"]]  # one store read for the chain behind the turns read (j4..j12)
    # the parent that held it purged (older, so purged first): nothing is shown for it
    with closing(sqlite3.connect(store.path)) as db, db:
        db.execute("UPDATE wire_records SET capture_json=NULL WHERE record_id='r2'")
    again = WireVerdict.model_validate(wire.model_dump(exclude={"first_difference": {"expected_text", "observed_text"}}))
    await fill_captured_texts(store, "u1", "c1", "j12", again, history)
    assert again.first_difference is not None
    assert (again.first_difference.expected_text, again.first_difference.observed_text) == (None, "q2 changed")
