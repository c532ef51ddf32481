"""Per-member locks that exist only while someone holds or awaits them.

Turns of one member run one at a time (SPEC section 8). A lock per member kept forever
grows with every chat the host ever served; here an entry is created by its first holder
and removed by its last, so the map's size is the number of members with work in flight.
A key present in the map is exactly a member whose lock is held or awaited: that is what
"busy" means to the idle stop, the sandbox limit and the memory budget.

A :class:`Sighting` lets a read of a member's state taken before its lock stand for a read
under it (issue 16: the job's claim reads the member in its own transaction, one store round
trip fewer per turn). Every writer of a member's state in this daemon holds the member's lock
(turns, forks, chat deletion, recovery), so a read that began after the last release of the
lock is as fresh as one taken after acquiring it; a release after the sighting spoils it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio

MemberKey = tuple[str, str, str]  # (user_id, chat_id, member_id)


@dataclass
class _Entry:
    lock: anyio.Lock = field(default_factory=lambda: anyio.Lock(fast_acquire=True))  # free: no loop trip
    users: int = 0


@dataclass(eq=False)
class Sighting:
    """Taken before a read of ``key``'s state outside its lock; ``spoiled`` once any holder of
    the member's lock released it since (the read may predate that holder's writes)."""

    key: MemberKey
    spoiled: bool = False


class MemberLocks:
    def __init__(self) -> None:
        self._entries: dict[MemberKey, _Entry] = {}
        self._sightings: dict[MemberKey, list[Sighting]] = {}

    def sight(self, key: MemberKey) -> Sighting:
        """Before reading the member's state outside its lock; :meth:`unsight` when done."""
        sighting = Sighting(key)
        self._sightings.setdefault(key, []).append(sighting)
        return sighting

    def unsight(self, sighting: Sighting) -> None:
        """Idempotent; the sighting keeps its verdict."""
        left = self._sightings.get(sighting.key)
        if left is not None and sighting in left:
            left.remove(sighting)
            if not left:
                del self._sightings[sighting.key]

    def _released(self, key: MemberKey) -> None:
        for sighting in self._sightings.get(key, ()):
            sighting.spoiled = True

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[MemberKey]:
        return list(self._entries)

    def busy(self, key: MemberKey) -> bool:
        return key in self._entries

    def held(self, key: MemberKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.lock.locked()

    def chat_busy(self, user_id: str, chat_id: str) -> bool:
        return any(k[:2] == (user_id, chat_id) for k in self._entries)

    def chat_keys(self, user_id: str, chat_id: str) -> list[MemberKey]:
        return [k for k in self._entries if k[:2] == (user_id, chat_id)]

    @asynccontextmanager
    async def hold(self, key: MemberKey) -> AsyncIterator[None]:
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = _Entry()
        entry.users += 1
        try:
            async with entry.lock:
                try:
                    yield
                finally:
                    self._released(key)
        finally:
            entry.users -= 1
            if entry.users == 0:
                del self._entries[key]

    def try_hold(self, key: MemberKey) -> AbstractAsyncContextManager[None] | None:
        """The lock at once, or None when anyone holds or awaits it: for work that must never
        wait on a member (retiring an idle resident), so it can never wait on a turn."""
        if key in self._entries:
            return None
        entry = self._entries[key] = _Entry(users=1)
        entry.lock.acquire_nowait()

        @asynccontextmanager
        async def held() -> AsyncIterator[None]:
            try:
                yield
            finally:
                self._released(key)
                entry.lock.release()
                entry.users -= 1
                if entry.users == 0:
                    del self._entries[key]

        return held()

    @asynccontextmanager
    async def hold_all(self, keys: Iterable[MemberKey]) -> AsyncIterator[None]:
        """Several members' locks, taken in a fixed order so two callers cannot deadlock."""
        async with AsyncExitStack() as stack:
            for key in sorted(set(keys)):
                await stack.enter_async_context(self.hold(key))
            yield
