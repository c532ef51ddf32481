"""The texts behind a wire gap's first difference, when the operator turned capture on.

The wire verdict keeps digests only (SPEC 12); with ``CLOUD_AGENT_WIRE_CAPTURE=1`` the ledger
also keeps each request's and reply's message texts for a while. The inspector shows the two
texts of the first difference only when it can prove them: a captured text is used only if its
sha256 is the digest the verdict names, so a purged, partial or unrelated capture shows
nothing rather than a wrong text. The observed text is looked for in the diagnosed turn's own
records, the expected one in that turn and the member's earlier turns (newest first).

A request stored as a difference (proxy.stored_digest) captured only the texts after the ones
it shares with its parent record, whose capture (or its parent's, back to the chain's whole
record) holds the others: when the turns' own records do not hold a text, the records their
parents lead back to are read, in one store read, up to two chains' length. A parent whose
capture was purged before its child's shows nothing for the texts only it held.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING

from proxy.digest import sha256_text
from proxy.stored_digest import KEYFRAME_DEPTH
from state.receipts import Receipt
from state.wire_ledger import WireRecordRow

if TYPE_CHECKING:
    from runner.diagnosis import WireVerdict
    from state.contract import StoreContract

EARLIER_TURNS = 8  # how far back an expected text is looked for (a gap names a recent message)
PARENT_READS = 2 * KEYFRAME_DEPTH  # ancestor records read, at most (a chain reaches a whole one sooner)


def _texts(capture_json: str | None) -> Iterable[str]:
    if not capture_json:
        return ()
    try:
        doc = json.loads(capture_json)
    except ValueError:
        return ()
    messages = [*(doc.get("request") or []), *(doc.get("reply") or [])]
    return (m["text"] for m in messages if isinstance(m, dict) and isinstance(m.get("text"), str))


def _text_of(row: WireRecordRow, digest: str) -> str | None:
    return next((text for text in _texts(row.capture_json) if sha256_text(text) == digest), None)


async def _find(store: StoreContract, user_id: str, chat_id: str, job_ids: Iterable[str], digest: str) -> str | None:
    seen: set[str] = set()
    parents: list[str] = []  # of the records read, newest turn's first
    for job_id in job_ids:
        for row in await store.wire_records_of_job(user_id, chat_id, job_id):
            seen.add(row.record_id)
            if (text := _text_of(row, digest)) is not None:
                return text
            if row.digest_parent is not None:
                parents.append(row.digest_parent)
    # every chain behind them in one read, nearest first from the newest turn's first record's
    # parent, so the limit keeps the records a walk along them would have read
    seeds = [p for p in parents if p not in seen]
    if seeds:
        for row in await store.wire_ancestors(user_id, chat_id, seeds, stop=seen, limit=PARENT_READS):
            if (text := _text_of(row, digest)) is not None:
                return text
    return None


async def fill_captured_texts(store: StoreContract, user_id: str, chat_id: str, job_id: str,
                              wire: WireVerdict | None, history: list[Receipt]) -> None:
    """Set ``expected_text``/``observed_text`` on the verdict of job ``job_id`` where the
    capture proves them; ``history`` is the member's receipts up to that turn."""
    diff = wire.first_difference if wire else None
    if diff is None:
        return
    this = job_id
    earlier = [r.job_id for r in reversed(history) if r.job_id != job_id][:EARLIER_TURNS]
    if diff.observed_digest and diff.observed_text is None:
        diff.observed_text = await _find(store, user_id, chat_id, [this], diff.observed_digest)
    if diff.expected_digest and diff.expected_text is None:
        diff.expected_text = await _find(store, user_id, chat_id, [this, *earlier], diff.expected_digest)
