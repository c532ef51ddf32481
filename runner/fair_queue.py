"""A queue that is fair between users: FIFO within a user, round-robin across users.

Users wait in a ring. The user at the front gives up its oldest job and, if it has more,
goes to the back of the ring; a user new to the queue joins at the back. So one user's
hundred queued jobs let every other waiting user's next job through after at most one of
theirs, and a job's place (its ``position``) can be computed exactly from the ring.
Pure and synchronous: the admission controller owns the waiting and the timing.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


@dataclass
class FairQueue(Generic[T]):
    _ring: deque[str] = field(default_factory=deque)
    _queues: dict[str, deque[T]] = field(default_factory=dict)

    def __len__(self) -> int:
        return sum(len(q) for q in self._queues.values())

    def __bool__(self) -> bool:
        return bool(self._ring)

    def users(self) -> int:
        return len(self._ring)

    def push(self, user: str, item: T) -> None:
        q = self._queues.get(user)
        if q is None:
            q = self._queues[user] = deque()
            self._ring.append(user)
        q.append(item)

    def peek(self) -> T | None:
        return self._queues[self._ring[0]][0] if self._ring else None

    def pop(self) -> T | None:
        """The next job in fair order (the front user's oldest)."""
        if not self._ring:
            return None
        user = self._ring.popleft()
        q = self._queues[user]
        item = q.popleft()
        if q:
            self._ring.append(user)
        else:
            del self._queues[user]
        return item

    def remove(self, user: str, item: T) -> bool:
        """Take a job out (timed out or cancelled); a user left with none leaves the ring."""
        q = self._queues.get(user)
        if q is None or item not in q:
            return False
        q.remove(item)
        if not q:
            del self._queues[user]
            self._ring.remove(user)
        return True

    def order(self) -> Iterator[T]:
        """Every queued job in the order it will be served (if nothing else arrives)."""
        queues = [list(self._queues[u]) for u in self._ring]
        depth = max((len(q) for q in queues), default=0)
        for rnd in range(depth):
            for q in queues:
                if rnd < len(q):
                    yield q[rnd]

    def positions(self) -> dict[T, int]:
        """1-based place of every queued job in :meth:`order` (1 = served next)."""
        return {item: i for i, item in enumerate(self.order(), start=1)}
