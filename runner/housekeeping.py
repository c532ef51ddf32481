"""The supervisor's maintenance loops: the heartbeat (readiness and the control plane read
it), the idle loop (residents retired, idle sandboxes stopped) and the periodic sweeps.

Each loop runs in the supervisor's task group until that is cancelled; none of them lets an
error of the engine end it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import anyio
import structlog

from runner.capacity import HostCapacity
from runner.config import Settings
from runner.member_locks import MemberLocks
from runner.residents import Resident, ResidentPool
from runner.sweeps import Sweeps
from sandbox_manager.sandboxes import SandboxManager
from state.contract import StoreContract
from state.records import SandboxState

log = structlog.get_logger("supervisor")


@dataclass
class Heartbeat:
    interval_s: float
    last_beat: datetime | None = None
    beats: int = 0


class Housekeeping:
    def __init__(self, settings: Settings, *, store: StoreContract, manager: SandboxManager, pool: ResidentPool,
                 locks: MemberLocks, capacity: HostCapacity, sweeps: Sweeps, heartbeat: Heartbeat) -> None:
        self.settings = settings
        self.store = store
        self.manager = manager
        self.pool = pool
        self.locks = locks
        self.capacity = capacity
        self.sweeps = sweeps
        self.heartbeat = heartbeat

    async def beat_loop(self) -> None:
        while True:
            self.heartbeat.last_beat = datetime.now(UTC)
            self.heartbeat.beats += 1
            await anyio.sleep(self.heartbeat.interval_s)

    async def idle_loop(self) -> None:
        """Retire idle resident processes; stop idle sandboxes (writable layer kept)."""
        period = max(1.0, min(self.settings.resident_idle_s, self.settings.idle_stop_s) / 4)
        while True:
            await anyio.sleep(period)
            now = time.monotonic()
            # A resident whose process died on its own is pruned here, not kept forever.
            await self._retire_unused(lambda r: not r.alive, "exited")
            await self._retire_unused(lambda r: now - r.last_used > self.settings.resident_idle_s, "idle")
            for rec in await self.store.list_sandboxes(SandboxState.RUNNING):
                if rec.host_id != self.manager.config.host_id:
                    continue  # a fleet's store holds every host's sandboxes
                idle = (datetime.now(UTC) - rec.last_used_at).total_seconds()
                chat = (rec.user_id, rec.chat_id)
                if idle > self.settings.idle_stop_s and not self.capacity.chat_busy(chat):
                    await self.capacity.stop(chat, "idle")

    async def _retire_unused(self, pred: Callable[[Resident], bool], why: str) -> None:
        """Retire residents matching ``pred`` whose member lock is free, holding it meanwhile:
        a job for that member then waits for the retirement instead of racing it."""
        for r in self.pool.residents():
            if pred(r) and (held := self.locks.try_hold(r.key)) is not None:
                async with held:
                    await self.pool.retire(r.key, why)

    async def sweep_loop(self) -> None:
        while True:
            await anyio.sleep(self.settings.sweep_interval_s)
            for sweep in (self.sweeps.disk, self.sweeps.retention):
                try:
                    await sweep()
                except Exception as exc:  # noqa: BLE001 - the engine may be down; the next sweep retries
                    log.warning("sweep.failed", sweep=sweep.__name__, error=repr(exc))
