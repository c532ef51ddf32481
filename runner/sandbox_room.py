"""Room for running sandboxes (CLOUD_AGENT_MAX_RUNNING_SANDBOXES).

The daemon's view of which chats have a running sandbox and when each was last used. A
job is placed when its chat's sandbox already runs (or another admitted job will start
it), when there is room for one more, or when the least recently used idle running
sandbox can be stopped for it — never one with a turn in flight, an admitted job or a
member lock held (``busy``). The stop is chosen here, synchronously, so two jobs can
never both count on the same victim; the job that was given it stops it before starting
its own sandbox. Pure and synchronous.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

Chat = tuple[str, str]  # (user_id, chat_id)


@dataclass(frozen=True)
class Placement:
    victim: Chat | None = None  # stop this sandbox first


class SandboxRoom:
    def __init__(self, max_running: int | None, busy: Callable[[Chat], bool],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_running = max_running
        self.busy = busy
        self.clock = clock
        self.running: dict[Chat, float] = {}  # chat -> last used
        self.admitted: Counter[Chat] = Counter()
        self.evicting: set[Chat] = set()

    def occupied(self) -> int:
        return len(self.running.keys() | self.admitted.keys())

    def mark_running(self, chat: Chat) -> None:
        self.running[chat] = self.clock()

    def mark_stopped(self, chat: Chat) -> None:
        self.running.pop(chat, None)
        self.evicting.discard(chat)

    def place(self, chat: Chat) -> Placement | None:
        """Where a job for ``chat`` can run now (None: it has to wait); counts it as admitted."""
        placement = self._placement(chat)
        if placement is not None:
            self.admitted[chat] += 1
        return placement

    def fits_at_once(self, chat: Chat) -> bool:
        """:meth:`place` would answer at once and stop nobody (it is not asked: placing counts)."""
        return chat not in self.evicting and self._needs_no_room(chat)

    def _needs_no_room(self, chat: Chat) -> bool:
        """Its sandbox runs or is admitted already, or a free slot is there for it."""
        return (chat in self.running or chat in self.admitted or self.max_running is None
                or self.occupied() < self.max_running)

    def release(self, chat: Chat) -> None:
        self.admitted[chat] -= 1
        if self.admitted[chat] <= 0:
            del self.admitted[chat]
        if chat in self.running:
            self.running[chat] = self.clock()

    def _placement(self, chat: Chat) -> Placement | None:
        if chat in self.evicting:
            return None  # wait for its stop to finish, then it needs room like any stopped one
        if self._needs_no_room(chat):
            return Placement()
        idle = [(used, c) for c, used in self.running.items()
                if c not in self.evicting and c not in self.admitted and not self.busy(c)]
        if not idle:
            return None
        victim = min(idle)[1]
        self.evicting.add(victim)
        return Placement(victim=victim)
