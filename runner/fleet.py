"""This daemon as one host of a fleet (SPEC 16): registration, the lease heartbeat, chat
placement and the ``host_lost`` answer.

The shared store is the only coordinator. A host registers (host id, API URL, capacity) and
renews a lease judged by the store's clock; the lease's epoch is the fencing token every
claim and commit of this host checks in its own transaction (``StoreContract.bind_lease``).
A chat is placed on one host epoch when its first job arrives; if that epoch's lease expires
the chat is ``LOST`` with reason ``host_lost`` everywhere, for good: a sandbox is never
restored on another host, and a host that comes back gets a new epoch, not its old chats.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

import anyio
import structlog

from state.contract import HostLease, MemberOutcome, Placement, StoreContract, StoreUnavailable
from state.jobs import Job
from state.receipts import ContextStatus, Outcome, Receipt
from state.records import JobRecord, SandboxState

log = structlog.get_logger("fleet")

HOST_LOST = "host_lost"


@dataclass(frozen=True)
class Route:
    kind: Literal["local", "forward", "lost", "fenced", "no_host"]
    placement: Placement | None = None


@dataclass(frozen=True)
class LostAnswer:
    kind: Literal["done", "running", "conflict"]
    receipt: Receipt | None = None
    fresh: bool = False  # this call committed it


class Fleet:
    def __init__(self, store: StoreContract, *, host_id: str, api_url: str, capacity: int, ttl_s: float,
                 lease_paused: Callable[[], bool] | None = None) -> None:
        self.store = store
        self.host_id = host_id
        self.api_url = api_url
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.lease: HostLease | None = None
        self.fenced = False
        self._valid_until = 0.0  # monotonic
        # test seam only (tests/support builds daemons with it); no setting reaches it
        self._lease_paused = lease_paused

    # -- membership ---------------------------------------------------------------------------

    def lease_valid(self) -> bool:
        """By this host's own clock, conservatively: a lease counts from *before* the request
        that granted it, so the host gives up no later than the store does."""
        return not self.fenced and time.monotonic() < self._valid_until

    async def join(self) -> HostLease:
        await self.store.open()
        t = time.monotonic()
        lease = await self.store.register_host(self.host_id, self.api_url, self.capacity, self.ttl_s)
        self._valid_until = t + self.ttl_s
        self.lease = lease
        self.fenced = False
        self.store.bind_lease(lease)
        log.info("fleet.joined", host_id=self.host_id, epoch=lease.epoch, api_url=self.api_url,
                 capacity=self.capacity, ttl_s=self.ttl_s)
        return lease

    async def _lease_loop(self) -> None:
        """Renew every third of the TTL. An attempt gets at most that long, and a failed one is
        retried within a second: an outage shorter than the lease's remaining time (a store
        restart) costs nothing, and no single stuck call can outlast the lease."""
        assert self.lease is not None
        period = self.ttl_s / 3
        retry = min(1.0, period / 2)
        delay = period
        while not self.fenced:
            await anyio.sleep(delay)
            if self._lease_paused is not None and self._lease_paused():
                delay = period
                continue
            t = time.monotonic()
            failure: str | None = f"no answer within {period:.1f} s"  # unless it answers in time
            with anyio.move_on_after(period):
                try:
                    renewed = await self.store.renew_lease(self.lease, self.ttl_s)
                    failure = None
                except StoreUnavailable as exc:
                    failure = str(exc)
            if failure is not None:
                log.warning("fleet.renew_failed", error=failure, lease_left_s=round(self._valid_until - t, 1))
                delay = retry
                continue
            if renewed is None:
                # Expired or superseded: this epoch is over. Stop accepting work; the store
                # refuses its claims and commits anyway. A restart registers a new epoch.
                self.fenced = True
                log.error("fleet.fenced", host_id=self.host_id, epoch=self.lease.epoch)
                return
            self.lease = renewed
            self._valid_until = t + self.ttl_s
            delay = period

    @asynccontextmanager
    async def running(self) -> AsyncIterator[Fleet]:
        await self.join()
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._lease_loop)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    # -- routing ------------------------------------------------------------------------------

    def is_mine(self, p: Placement) -> bool:
        return self.lease is not None and p.host_id == self.host_id and p.host_epoch == self.lease.epoch

    async def route(self, user_id: str, chat_id: str, *, place: bool) -> Route:
        """Where a request for this chat is served. ``place``: a job may place a new chat."""
        if not self.lease_valid():
            return Route("fenced")
        p = await (self.store.place_chat(user_id, chat_id) if place else self.store.get_placement(user_id, chat_id))
        if p is None:
            return Route("no_host" if place else "local")
        if self.is_mine(p):
            if not p.live:  # the store (whose clock judges leases) says this epoch is over
                self.fenced = True
                log.error("fleet.fenced", host_id=self.host_id, epoch=p.host_epoch, seen="placement")
                return Route("fenced", p)
            return Route("local", p)
        if p.live:
            return Route("forward", p)
        return Route("lost", p)

    # -- host_lost ------------------------------------------------------------------------------

    async def condemn(self, user_id: str, chat_id: str) -> None:
        """The chat's host epoch is gone: its records say LOST host_lost from now on (sticky)."""
        sb = await self.store.get_sandbox(user_id, chat_id)
        if sb is not None and sb.state != SandboxState.LOST:
            await self.store.set_sandbox_state(user_id, chat_id, SandboxState.LOST, HOST_LOST)
        for m in await self.store.list_members(user_id, chat_id):
            await self.store.mark_member_lost(user_id, chat_id, m.member_id, HOST_LOST)

    async def answer_lost(self, job: Job, owner: str) -> LostAnswer:
        """Refuse a job of a chat whose host is lost, behind the fleet-wide job fence."""
        await self.condemn(job.user_id, job.chat_id)
        claim = await self.store.claim_job(job.job_id, job.user_id, job.chat_id, job.member_id, job.digest(), owner)
        if claim.kind == "conflict":
            return LostAnswer("conflict")
        if claim.kind == "done":
            assert claim.job is not None and claim.job.receipt_json is not None
            return LostAnswer("done", Receipt.model_validate_json(claim.job.receipt_json))
        if claim.kind == "running":
            assert claim.job is not None
            closed = await self.close_orphan(claim.job)
            return LostAnswer("running") if closed is None else LostAnswer("done", closed)
        member = await self.store.get_member(job.user_id, job.chat_id, job.member_id)
        sb = await self.store.get_sandbox(job.user_id, job.chat_id)
        locator = member.locator.id if member and member.locator else None
        ts = datetime.now(UTC)
        receipt = Receipt(job_id=job.job_id, user_id=job.user_id, chat_id=job.chat_id, member_id=job.member_id,
                          runtime=job.runtime, context_status=ContextStatus.LOST, outcome=Outcome.REFUSED,
                          reason=HOST_LOST, locator_before=locator, locator_after=locator,
                          sandbox={"container_id": sb.container_id if sb else None,
                                   "image_id": sb.image_id if sb else None},
                          started_at=ts, finished_at=ts)
        outcome = MemberOutcome(ContextStatus.LOST.value, Outcome.REFUSED.value) if member else None
        await self.store.finish_job(job.user_id, job.job_id, receipt.model_dump_json(), outcome)
        log.warning("fleet.host_lost", job_id=job.job_id, owner_host=await self._owner_of(job))
        return LostAnswer("done", receipt, fresh=True)

    async def _owner_of(self, job: Job) -> str | None:
        p = await self.store.get_placement(job.user_id, job.chat_id)
        return None if p is None else f"{p.host_id}#{p.host_epoch}"

    async def close_orphan(self, rec: JobRecord) -> Receipt | None:
        """A running job claimed by a host epoch that is no longer live never commits: close it
        as ``not_settled`` ``host_lost`` (the CLI may have run: it is never re-run)."""
        if rec.host_id is None or (self.lease is not None and rec.host_id == self.host_id
                                   and rec.host_epoch == self.lease.epoch):
            return None
        member = await self.store.get_member(rec.user_id, rec.chat_id, rec.member_id)
        locator = member.locator.id if member and member.locator else None
        receipt = Receipt(job_id=rec.job_id, user_id=rec.user_id, chat_id=rec.chat_id, member_id=rec.member_id,
                          runtime=member.runtime if member else "unknown", context_status=None,
                          outcome=Outcome.NOT_SETTLED, reason=HOST_LOST, locator_before=locator,
                          locator_after=locator, started_at=rec.created_at, finished_at=datetime.now(UTC))
        if not await self.store.close_orphaned_job(rec.user_id, rec.job_id, receipt.model_dump_json()):
            return None
        log.warning("fleet.orphan_closed", job_id=rec.job_id, host=f"{rec.host_id}#{rec.host_epoch}")
        return receipt
