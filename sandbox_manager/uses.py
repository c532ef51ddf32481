"""Which containers serve a turn right now (a replacement waits for them to finish).

A sandbox is replaced (recreated, upgraded, migrated) under the manager's per-chat lock, so
no new turn can resolve the old container meanwhile; turns that resolved it earlier hold a
use until they end, and the replacement waits for those uses to drop to zero before it
retires the old container's processes. A turn waiting to resolve holds no use, so two
members of one chat can never wait on each other.
"""

from __future__ import annotations

import anyio


class ContainerUses:
    def __init__(self) -> None:
        self._count: dict[str, int] = {}
        self._idle: dict[str, anyio.Event] = {}

    def acquire(self, container_id: str) -> None:
        self._count[container_id] = self._count.get(container_id, 0) + 1

    def release(self, container_id: str) -> None:
        n = self._count.get(container_id, 0) - 1
        if n > 0:
            self._count[container_id] = n
            return
        self._count.pop(container_id, None)
        event = self._idle.pop(container_id, None)
        if event is not None:
            event.set()

    def in_use(self, container_id: str) -> int:
        return self._count.get(container_id, 0)

    async def wait_unused(self, container_id: str) -> None:
        """Until no turn uses the container (the caller bounds the wait with a cancel scope)."""
        while self._count.get(container_id, 0) > 0:
            event = self._idle.setdefault(container_id, anyio.Event())
            await event.wait()
