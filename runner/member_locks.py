"""Per-member locks that exist only while someone holds or awaits them.

Turns of one member run one at a time (SPEC section 8). A lock per member kept forever
grows with every chat the host ever served; here an entry is created by its first holder
and removed by its last, so the map's size is the number of members with work in flight.
A key present in the map is exactly a member whose lock is held or awaited: that is what
"busy" means to the idle stop, the sandbox limit and the memory budget.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from dataclasses import dataclass, field

import anyio

MemberKey = tuple[str, str, str]  # (user_id, chat_id, member_id)


@dataclass
class _Entry:
    lock: anyio.Lock = field(default_factory=anyio.Lock)
    users: int = 0


class MemberLocks:
    def __init__(self) -> None:
        self._entries: dict[MemberKey, _Entry] = {}

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
                yield
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
