"""The host's capacity, wired to the supervisor's parts: turn slots and the fair queue
(runner.admission), room for running sandboxes (runner.sandbox_room), and the stops they
cause. "Busy" — never stopped or evicted — means a member lock of the chat is held or
awaited, or a job for it was admitted and has not finished.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

import structlog

from runner.admission import Admission, Grant, HostBusy, QueuedEvent
from runner.capacity_metrics import CapacityMetrics
from runner.config import Settings
from runner.job_stream import JobStream
from runner.member_locks import MemberLocks
from runner.residents import ResidentPool
from runner.sandbox_room import Chat, SandboxRoom
from sandbox_manager.sandboxes import SandboxManager
from state.records import SandboxState
from state.contract import StoreContract

log = structlog.get_logger("capacity")


class HostCapacity:
    def __init__(self, settings: Settings, *, manager: SandboxManager, pool: ResidentPool, locks: MemberLocks,
                 metrics: CapacityMetrics, on_stopped: Callable[[str, str], Awaitable[None]] | None = None) -> None:
        self.manager = manager
        self.on_stopped = on_stopped  # e.g. close the stopped sandbox's model socket
        self.pool = pool
        self.locks = locks
        self.metrics = metrics
        self.room = SandboxRoom(settings.max_running_sandboxes, busy=self.chat_busy)
        self.admission = Admission(max_turns=settings.max_turns, timeout_s=settings.queue_timeout_s, room=self.room)
        manager.watch(self._sandbox_changed)
        metrics.turns_limit.set(settings.max_turns or 0)
        metrics.sandboxes_limit.set(settings.max_running_sandboxes or 0)
        metrics.watch(depth=lambda: self.admission.depth, running=lambda: self.admission.running,
                      sandboxes=lambda: len(self.room.running))

    def chat_busy(self, chat: Chat) -> bool:
        return self.locks.chat_busy(*chat) or chat in self.room.admitted

    async def load(self, store: StoreContract) -> None:
        """The sandboxes the store records as running, least recently used first."""
        now_wall, now_mono = datetime.now(UTC), time.monotonic()
        for rec in await store.list_sandboxes(SandboxState.RUNNING):
            if rec.host_id != self.manager.config.host_id:
                continue  # a fleet's store holds every host's sandboxes
            age = (now_wall - rec.last_used_at).total_seconds()
            self.room.running[(rec.user_id, rec.chat_id)] = now_mono - max(0.0, age)

    def _sandbox_changed(self, user_id: str, chat_id: str, state: SandboxState) -> None:
        if state == SandboxState.RUNNING:
            self.room.mark_running((user_id, chat_id))
        else:
            self.room.mark_stopped((user_id, chat_id))
            self.admission.dispatch()  # room may have come free for the front of the queue

    async def admit(self, user_id: str, chat_id: str, job_id: str, stream: JobStream) -> Grant:
        """Wait for a turn slot and room (HostBusy at the queue timeout); queued events go to ``stream``."""
        def queued(event: QueuedEvent) -> None:
            stream.emit(event.model_dump())

        try:
            grant = await self.admission.admit(user_id, chat_id, job_id, queued)
        except HostBusy:
            self.metrics.host_busy.inc()
            raise
        self.metrics.queue_wait.observe(grant.waited_s)
        return grant

    async def make_room(self, grant: Grant) -> None:
        """Stop the sandbox this job was given to make room for its own (if any)."""
        if grant.victim is not None:
            await self.stop(grant.victim, "sandbox_limit")

    async def stop(self, chat: Chat, cause: str) -> bool:
        """Retire the chat's residents and stop its sandbox (writable layer kept)."""
        try:
            async with self.locks.hold_all(self.locks.chat_keys(*chat)):
                await self.pool.retire_where(lambda r: r.key[:2] == chat, f"sandbox stop: {cause}")
                stopped = await self.manager.stop(*chat)
                if self.on_stopped is not None:
                    await self.on_stopped(*chat)
        finally:
            self.room.mark_stopped(chat)
            self.admission.dispatch()
        if stopped:
            self.metrics.sandbox_stops.labels(cause=cause).inc()
            log.info("sandbox.stopped_for_capacity", cause=cause)
        return stopped

    async def force_stop(self, chat: Chat, reason: str) -> bool:
        """Stop now and keep stopped with ``reason``, a turn in flight or not (disk_quota)."""
        try:
            await self.manager.block(*chat, reason)  # first: a turn resolving meanwhile is refused
            await self.pool.retire_where(lambda r: r.key[:2] == chat, f"sandbox stop: {reason}")
            stopped = await self.manager.stop(*chat)
            if self.on_stopped is not None:
                await self.on_stopped(*chat)
        finally:
            self.room.mark_stopped(chat)
            self.admission.dispatch()
        self.metrics.sandbox_stops.labels(cause=reason).inc()
        return stopped

    async def expire(self, chat: Chat, reason: str) -> bool:
        """Remove the chat's sandbox for good (retention); jobs for it wait meanwhile."""
        self.room.evicting.add(chat)
        try:
            await self.pool.retire_where(lambda r: r.key[:2] == chat, f"sandbox removed: {reason}")
            removed = await self.manager.expire(*chat, reason)
            if self.on_stopped is not None:
                await self.on_stopped(*chat)
        finally:
            self.room.mark_stopped(chat)
            self.admission.dispatch()
        if removed:
            self.metrics.sandbox_removals.labels(cause=reason).inc()
            log.info("sandbox.removed", cause=reason)
        return removed

    def release(self, grant: Grant) -> None:
        self.admission.release(grant)
