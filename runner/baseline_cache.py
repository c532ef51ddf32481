"""The members' last wire baselines kept parsed, by their stored text (SPEC 12, issue 16).

A turn's verdict compares its first request with the baseline its member's previous turn left
(``proxy.Baseline``: that request's whole conversation as digests, and its reply). The store
keeps it as JSON, and parsing it back is O(history): about two thirds of judging a turn, on
the commit's path, inside its transaction. The daemon that committed a baseline still has it
parsed, so the next turn's verdict takes that object — but only when the stored text is the
very text it was made from: a commit that rolled back, another host's turn or a restart find
a different text (or none) and parse what the store holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from proxy import Baseline

MemberKey = tuple[str, str, str]


class BaselineCache:
    """Bounded, least recently used first out; safe from any thread (SQLite judges on the
    store's thread, PostgreSQL on the event loop)."""

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._by_member: OrderedDict[MemberKey, tuple[str, Baseline]] = OrderedDict()

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
        """``baseline``, about to be committed as ``text``, for the member's next verdict."""
        with self._lock:
            self._by_member[member] = (text, baseline)
            self._by_member.move_to_end(member)
            while len(self._by_member) > self.size:
                self._by_member.popitem(last=False)

    def __len__(self) -> int:
        return len(self._by_member)
