"""The members' last wire baselines kept parsed, by their stored text (SPEC 12, issue 16).

A turn's verdict compares its first request with the baseline its member's previous turn left
(``proxy.Baseline``: that request's whole conversation as digests, and its reply). The store
keeps it as JSON, and parsing it back is O(history): about two thirds of judging a turn, on
the commit's path, inside its transaction. The daemon that committed a baseline still has it
parsed, so the next turn's verdict takes that object — but only when the stored text is the
very text it was made from: a commit that rolled back, another host's turn or a restart find
a different text (or none) and parse what the store holds.

A baseline grows with its member's history, so the cache is bounded by the bytes of the texts
it keeps as well as by members; a deleted chat's members go at once (they have no next turn).
The soak (tests/bench/soak.py, six Codex chats deleted and begun again every 100 turns) found
the daemon keeping one baseline per chat ever seen, bounded only at 1024 members: its RSS grew
77.8 -> 90.6 MiB in 10 minutes (111 chats), and stays flat with them forgotten.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from proxy import Baseline

MemberKey = tuple[str, str, str]


# the texts' bytes kept at most: a 100-turn chat's baseline is ~17 KB of text, and its parse a
# few times that in objects
MAX_BYTES = 8 * 1024 * 1024


class BaselineCache:
    """Bounded (members and bytes), least recently used first out; safe from any thread
    (SQLite judges on the store's thread, PostgreSQL on the event loop)."""

    def __init__(self, size: int = 1024, max_bytes: int = MAX_BYTES) -> None:
        self.size, self.max_bytes = size, max_bytes
        self._lock = threading.Lock()
        self._by_member: OrderedDict[MemberKey, tuple[str, Baseline]] = OrderedDict()
        self._bytes = 0  # len() of the kept texts

    def parsed(self, member: MemberKey, text: str) -> Baseline:
        """``text`` (a stored baseline) as a :class:`Baseline`, parsed only if not kept."""
        with self._lock:
            kept = self._by_member.get(member)
            if kept is not None and kept[0] == text:
                self._by_member.move_to_end(member)
                return kept[1]
        baseline = Baseline.model_validate_json(text)
        self.keep(member, text, baseline)
        return baseline

    def keep(self, member: MemberKey, text: str, baseline: Baseline) -> None:
        """``baseline``, about to be committed as ``text``, for the member's next verdict (a
        text over the byte bound is not kept: its member's next verdict parses it)."""
        with self._lock:
            self._drop(member)
            if len(text) > self.max_bytes:
                return
            self._by_member[member] = (text, baseline)
            self._bytes += len(text)
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
            self._bytes -= len(kept[0])

    @property
    def kept_bytes(self) -> int:
        return self._bytes

    def members(self) -> list[MemberKey]:
        with self._lock:
            return list(self._by_member)

    def __len__(self) -> int:
        return len(self._by_member)
