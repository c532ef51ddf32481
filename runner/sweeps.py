"""Periodic sweeps of retained sandboxes (CLOUD_AGENT_SWEEP_INTERVAL_S): the measured disk
bound and retention (SPEC section 13).

Disk: a running sandbox whose writable layer is over CLOUD_AGENT_SANDBOX_DISK_MB is stopped
at once — a turn in flight there is cut (its receipt is ``not_settled``): it is the one
filling the disk — and kept stopped with reason ``disk_quota`` (sandbox_manager.disk_bound
says how it is cleared). Other chats are untouched.

Retention: a sandbox unused for CLOUD_AGENT_RETAIN_DAYS is removed — residents retired,
container (and its writable layer) removed — and it and its members become LOST
``retention_expired``. A busy chat is never expired; while one is being expired, jobs for it
wait for admission (the room marks it as being stopped) and are then refused as LOST.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import structlog

from runner.capacity import HostCapacity
from sandbox_manager.disk_bound import DISK_QUOTA
from sandbox_manager.engine import NotFound
from state.records import SandboxRecord, SandboxState
from state.contract import StoreContract

log = structlog.get_logger("sweeps")

RETENTION_EXPIRED = "retention_expired"


class Sweeps:
    def __init__(self, *, store: StoreContract, capacity: HostCapacity, retain_days: float | None) -> None:
        self.store = store
        self.capacity = capacity
        self.manager = capacity.manager
        self.retain = None if retain_days is None else timedelta(days=retain_days)

    def expires_at(self, rec: SandboxRecord) -> datetime | None:
        if self.retain is None or rec.state == SandboxState.LOST:
            return None
        return rec.last_used_at + self.retain

    async def disk(self) -> int:
        stopped = 0
        for rec in await self.store.list_sandboxes(SandboxState.RUNNING):
            if rec.stop_reason or rec.host_id != self.manager.config.host_id:
                continue  # a fleet's store holds every host's sandboxes
            try:
                usage = await self.manager.disk.usage(rec)
            except NotFound:
                continue
            if usage is None or not usage.over:
                continue
            log.warning("sandbox.disk_quota", container=rec.container_name, used=usage.bytes, why=usage.why)
            await self.capacity.force_stop((rec.user_id, rec.chat_id), DISK_QUOTA)
            stopped += 1
        return stopped

    async def retention(self) -> int:
        if self.retain is None:
            return 0
        cutoff = datetime.now(UTC) - self.retain
        expired = 0
        for rec in await self.store.list_sandboxes():
            chat = (rec.user_id, rec.chat_id)
            if (rec.state == SandboxState.LOST or rec.host_id != self.manager.config.host_id
                    or rec.last_used_at > cutoff or self.capacity.chat_busy(chat)):
                continue
            if await self.capacity.expire(chat, RETENTION_EXPIRED):
                for member in await self.store.list_members(*chat):
                    await self.store.mark_member_lost(*chat, member.member_id, RETENTION_EXPIRED)
                expired += 1
        return expired
