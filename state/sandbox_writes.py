"""Whether a chat's sandbox record was written since a transaction read it.

A job's claim reads the chat's sandbox record in its own transaction (one store round trip
per turn fewer); the turn may take that read under the chat's lock only when no write of the
record can have landed since. Every write a store makes to a sandbox record is counted here
once it has returned (committed or not), in one order for all chats; a read notes the count
it was taken after. A write that lands after the read is counted after it, so the read is
stale exactly when its chat's last count is later than the read's; a write already counted
when the read was noted had committed before the read's transaction began.

This process's writes only: a record another process writes (another host of a fleet) is
that host's chat by placement, and a stale host is fenced at its commit (SPEC 16).
"""

from __future__ import annotations

from dataclasses import dataclass

from state.records import SandboxRecord

ChatKey = tuple[str, str]


@dataclass(frozen=True)
class SeenSandbox:
    """A chat's sandbox record as a claim's transaction read it (None: there was none)."""

    user_id: str
    chat_id: str
    record: SandboxRecord | None
    after: int  # the write count the read was taken after


class SandboxWrites:
    """Counted on the event loop, as each write's call returns (both backends)."""

    def __init__(self) -> None:
        self._count = 0
        self._last: dict[ChatKey, int] = {}  # one int per chat written since the process started
        self._all = 0  # a write whose chat the caller does not know counts for every chat

    def now(self) -> int:
        """The count a read about to begin is taken after."""
        return self._count

    def wrote(self, user_id: str, chat_id: str) -> None:
        self._count += 1
        self._last[(user_id, chat_id)] = self._count

    def wrote_some(self) -> None:
        """A write of a record whose chat the caller does not know: every read so far is stale."""
        self._count += 1
        self._all = self._count

    def deleted(self, user_id: str, chat_id: str) -> None:
        """The chat's records were deleted: its count goes (a host deleting chats all day would
        keep one per chat ever seen), and every read so far is stale, the chat's among them."""
        self._last.pop((user_id, chat_id), None)
        self.wrote_some()

    def __len__(self) -> int:
        """The chats with a count kept."""
        return len(self._last)

    def current(self, seen: SeenSandbox) -> bool:
        """No write of the chat's record can have landed since ``seen`` was read."""
        return max(self._last.get((seen.user_id, seen.chat_id), 0), self._all) <= seen.after
