"""What a member's last conversational request gave the audit, so its next one walks only its
new messages (issue 16).

A request carries its member's whole history, so the audit's walk (each message's texts, the
CLI's annotations stripped, each text hashed) cost O(history) Python per request: 2.1 of the
3.3 ms a 600-message request's audit took, on its record's way to the ledger, which the turn's
flush waits for. A member's next request nearly always starts with the previous one's messages:
compared as parsed JSON (dicts, lists and strings compare in C), the equal leading messages
take the previous walk's results, and only the rest is walked.

A message's results depend on that message alone (``proxy.digest.item_messages``), so they are
the same whichever request carried it. Equal JSON values keep their types (a dict equals only
a dict, a string only a string), which is all the walk looks at.

The memo holds the last request's parsed messages per member, bounded by their requests' bytes
(least recently used first out), and forgets a chat's members when its socket closes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import compress, count
from operator import ne
from typing import Any

from .digest import TextMessage
from .records import DigestEntry

MAX_BYTES = 8 << 20  # request bytes remembered in all (a 600-message request is ~130 kB)

ItemResult = tuple[tuple[TextMessage, DigestEntry], ...]  # one message's text messages and their digests


@dataclass(frozen=True)
class _Walked:
    api: str
    items: list[dict[str, Any]]
    results: list[ItemResult]
    weight: int


class AuditMemo:
    """Thread-safe: audits run on worker threads, a member's requests sometimes at once."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self.max_bytes = max_bytes
        self._walked: OrderedDict[tuple[str, str], _Walked] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def shared(self, member: tuple[str, str], api: str, items: Sequence[dict[str, Any]]) -> list[ItemResult]:
        """The results of ``items``' leading messages equal to the member's last request's."""
        with self._lock:
            last = self._walked.get(member)
            if last is not None:
                self._walked.move_to_end(member)
        if last is None or last.api != api:
            return []
        n = min(len(items), len(last.items))
        same = next(compress(count(), map(ne, items, last.items)), n)  # the first message that differs
        return last.results[:same]

    def keep(self, member: tuple[str, str], api: str, items: list[dict[str, Any]], results: list[ItemResult],
             weight: int) -> None:
        """Remember a conversational request's messages (``weight``: its body's bytes)."""
        if weight > self.max_bytes:
            self.forget(member)
            return
        with self._lock:
            old = self._walked.pop(member, None)
            self._bytes -= old.weight if old is not None else 0
            self._walked[member] = _Walked(api, items, results, weight)
            self._bytes += weight
            while self._bytes > self.max_bytes:
                _, gone = self._walked.popitem(last=False)
                self._bytes -= gone.weight

    def forget(self, member: tuple[str, str]) -> None:
        with self._lock:
            old = self._walked.pop(member, None)
            self._bytes -= old.weight if old is not None else 0

    def forget_chat(self, chat_key: str) -> None:
        with self._lock:
            for key in [k for k in self._walked if k[0] == chat_key]:
                self._bytes -= self._walked.pop(key).weight

    @property
    def bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._walked)
