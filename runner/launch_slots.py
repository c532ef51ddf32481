"""Launch slots: how many CLIs may be starting at once (CLOUD_AGENT_MAX_LAUNCHES).

A CLI's start — process start to handshake — is its most CPU-hungry moment: the bridged
servers (OpenCode, Kilo) load and compile a server of their own, more than a second of CPU
each. Started all at once on a small host they share the cores so thinly that none finishes
its handshake in time: 16 new Kilo chats at once on a 2-core host all ended
``handshake_timeout`` after 90 s (bench_supervisor's throughput phase), and their retries
did the same. With slots the same launches finish one after another, each in a few seconds.

A launch waits for a slot before anything starts (so the wait is not the handshake's
timeout), holds it through the handshake, and gives it back whatever happens. A turn on a
resident never takes one. The memory budget's gate is taken inside the slot: a launch that
waits for memory holds its slot, which only holds back other launches, never a turn (so
nothing here can wait for itself).
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge

log = structlog.get_logger("launch_slots")


def default_slots() -> int:
    """The host's CPU count as this process may use it (its affinity, not the machine's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class LaunchSlots:
    def __init__(self, slots: int, registry: CollectorRegistry) -> None:
        if slots < 1:
            raise ValueError(f"launch slots must be at least 1, not {slots}")
        self.slots = slots
        self._limiter = anyio.CapacityLimiter(slots)
        r = registry
        self.limit = Gauge("cloud_agent_launch_slots", "CLOUD_AGENT_MAX_LAUNCHES: CLIs starting at once.",
                           registry=r)
        self.limit.set(slots)
        self.starting = Gauge("cloud_agent_launches_starting", "CLIs starting now (process start to handshake).",
                              registry=r)
        self.starting.set_function(lambda: self._limiter.borrowed_tokens)
        self.waiting = Gauge("cloud_agent_launches_waiting", "Launches waiting now for a launch slot.", registry=r)
        self.waiting.set_function(lambda: self._limiter.statistics().tasks_waiting)
        self.waits = Counter("cloud_agent_launch_slot_waits", "Launches that waited for a slot, by runtime.",
                             ["runtime"], registry=r)

    @asynccontextmanager
    async def hold(self, runtime: str) -> AsyncIterator[None]:
        """A slot for one launch: taken at once when free, else after the earlier launches."""
        waits = self._limiter.available_tokens < 1 or self._limiter.statistics().tasks_waiting > 0
        if waits:
            self.waits.labels(runtime).inc()
        t = time.monotonic()
        async with self._limiter:
            if waits:
                log.info("launch.slot_taken", runtime=runtime, waited_ms=round((time.monotonic() - t) * 1000, 1))
            yield
