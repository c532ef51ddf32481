"""The members' last wire baselines kept parsed, by their stored text (SPEC 12, issue 16).

A turn's verdict compares its first request with the baseline its member's previous turn left
(``proxy.Baseline``: that request's whole conversation as digests, and its reply). The store
keeps it as JSON, and parsing it back is O(history): about two thirds of judging a turn, on
the commit's path, inside its transaction. The daemon that committed a baseline still has it
parsed, so the next turn's verdict takes that object — but only when the stored text is the
very text it was made from: a commit that rolled back, another host's turn or a restart find
a different text (or none) and parse what the store holds.

A baseline is stored as a reference to its record (``proxy.stored_digest.BaselineRef``): the
kept baseline also says which record its conversation is the whole digest of, so the next
turn's view need not read that record back (``SettleQuery.known``).

A baseline grows with its member's history, so the cache is bounded by the bytes of the
baselines it keeps (as their digests would take stored whole) as well as by members; a deleted chat's members go at once (they have no next turn).
The soak (tests/bench/soak.py, six Codex chats deleted and begun again every 100 turns) found
the daemon keeping one baseline per chat ever seen, bounded only at 1024 members: its RSS grew
77.8 -> 90.6 MiB in 10 minutes (111 chats), and stays flat with them forgotten.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from proxy import Baseline, DigestEntry

MemberKey = tuple[str, str, str]


# the baselines' bytes kept at most, as JSON: a 100-turn chat's baseline is ~17 KB, and its
# parse a few times that in objects
MAX_BYTES = 8 * 1024 * 1024
ENTRY_BYTES = 95  # one digest entry as JSON: {"role":"assistant","sha256":"<64 hex>"},


def weight(text: str, baseline: Baseline) -> int:
    """What a kept baseline counts against the bound: its stored text and its digest's entries."""
    return len(text) + ENTRY_BYTES * (len(baseline.conversation) + len(baseline.reply))


@dataclass(frozen=True)
class _Kept:
    text: str
    baseline: Baseline
    record_id: str | None  # the record whose whole digest baseline.conversation is
    weight: int


class BaselineCache:
    """Bounded (members and bytes), least recently used first out; safe from any thread
    (SQLite judges on the store's thread, PostgreSQL on the event loop)."""

    def __init__(self, size: int = 1024, max_bytes: int = MAX_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._lock = threading.Lock()
        self._by_member: OrderedDict[MemberKey, _Kept] = OrderedDict()
        self._bytes = 0  # weight() of the kept baselines

    def get(self, member: MemberKey, text: str) -> Baseline | None:
        """The baseline kept for the member if it was kept for this very stored ``text``."""
        with self._lock:
            kept = self._by_member.get(member)
            if kept is None or kept.text != text:
                return None
            self._by_member.move_to_end(member)
            return kept.baseline

    def parsed(self, member: MemberKey, text: str) -> Baseline:
        """``text`` (a baseline stored whole, before migration 11) as a :class:`Baseline`,
        parsed only if not kept."""
        baseline = self.get(member, text)
        if baseline is None:
            baseline = Baseline.model_validate_json(text)
            self.keep(member, text, baseline)
        return baseline

    def whole_digests(self, member: MemberKey) -> dict[str, list[DigestEntry]]:
        """The record whose whole digest the member's kept baseline holds, if any: {id: digest}."""
        with self._lock:
            kept = self._by_member.get(member)
            if kept is None or kept.record_id is None:
                return {}
            return {kept.record_id: kept.baseline.conversation}

    def keep(self, member: MemberKey, text: str, baseline: Baseline, record_id: str | None = None) -> None:
        """``baseline``, about to be committed as ``text``, for the member's next verdict (one
        over the byte bound is not kept: its member's next verdict reads it back)."""
        kept = _Kept(text, baseline, record_id, weight(text, baseline))
        with self._lock:
            self._drop(member)
            if kept.weight > self.max_bytes:
                return
            self._by_member[member] = kept
            self._bytes += kept.weight
            while len(self._by_member) > self.size or self._bytes > self.max_bytes:
                self._drop(next(iter(self._by_member)))

    def forget_chat(self, user_id: str, chat_id: str) -> int:
        """The chat was deleted: its members' baselines go; returns how many."""
        with self._lock:
            gone = [m for m in self._by_member if m[:2] == (user_id, chat_id)]
            for member in gone:
                self._drop(member)
            return len(gone)

    def _drop(self, member: MemberKey) -> None:
        kept = self._by_member.pop(member, None)
        if kept is not None:
            self._bytes -= kept.weight

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def members(self) -> list[MemberKey]:
        with self._lock:
            return list(self._by_member)

    def __len__(self) -> int:
        return len(self._by_member)
