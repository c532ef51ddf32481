"""The supervisor: owns the engine connection, the store, the resident processes and the
background work, and runs jobs behind the job fence.

Structured concurrency: every job and every maintenance loop runs in the supervisor's
task group, which the daemon's lifespan (or a library caller) owns. A client that stops
listening does not cancel its job; the receipt stays fetchable by job id.

The job path (fence, admission, claim, the turn, its receipt) is here; what runs before it
after a restart is ``runner.recovery``, the maintenance loops are ``runner.housekeeping``.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import anyio
import structlog
from anyio.abc import TaskGroup

from drivers.models import DriverOptions
from images.identity import carries_bridge, image_tag
from images.pins import Pins, load_pins
from runner.admission import Grant, HostBusy
from runner.alongside import alongside
from runner.capacity import HostCapacity
from runner.capacity_metrics import CapacityMetrics
from runner.chat_deletion import ChatDeletions, delete_chat
from runner.chat_status import chat_status
from runner.claim_on_disk import ClaimOnDisk
from runner.config import Settings
from runner.forks import Forker
from runner.housekeeping import Heartbeat, Housekeeping
from runner.job_stream import JobStream
from runner.launch_slots import LaunchSlots, default_slots
from runner.member_locks import MemberLocks, Sighting
from runner.metrics import Metrics
from runner.model_path import ModelPath
from runner.keepers import Keepers
from runner.not_settled import close_unsettled
from runner.recovery import Recovery
from runner.resident_memory import ResidentMemory
from runner.residents import ResidentPool
from runner.sweeps import Sweeps
from runner.hooks import TestHooks
from runner.turn import TurnRunner
from runner.turn_context import Detached, KnownMember
from sandbox_manager.engine import DockerEngine, Engine
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.jobs import CHAT_DELETED, ChatDeleted, ForkRequest, Job
from state.receipts import Receipt
from state.records import MemberRecord, SandboxState
from state.sandbox_writes import SeenSandbox
from state.backends import open_store
from state.contract import Fenced, StoreContract, StoreUnavailable
from telemetry import turn_trace
from telemetry.turn_trace import mark

log = structlog.get_logger("supervisor")


@dataclass
class Submission:
    kind: Literal["started", "done", "running", "conflict", "busy"]
    receipt: Receipt | None = None
    events: JobStream | None = None
    busy: HostBusy | None = None


@dataclass
class _Job:
    job: Job
    stream: JobStream
    grant: Grant
    # the member as the claim read it, and whether that read still stands under the member's lock
    claimed_member: MemberRecord | None
    sighting: Sighting
    claimed_sandbox: SeenSandbox | None = None  # the chat's sandbox record as the claim read it
    done: anyio.Event = field(default_factory=anyio.Event)
    receipt: Receipt | None = None
    # made at submit, entered when the job runs: a chat deletion may cancel it even before
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)


def driver_options(settings: Settings, pins: Pins | None = None) -> DriverOptions:
    """The launch inputs every driver gets on this host: the compaction policy, the pinned helper."""
    return DriverOptions(native_compaction=settings.native_compaction == "on",
                         helper_version=(pins or load_pins()).helper.version)


class Supervisor:
    def __init__(self, settings: Settings, *, engine: Engine, store: StoreContract, manager: SandboxManager,
                 gateway_url: str, hooks: TestHooks | None = None) -> None:
        self.settings = settings
        self.engine = engine
        self.store = store
        self.manager = manager
        self.gateway_url = gateway_url
        self.owner = uuid.uuid4().hex
        self.keepers = Keepers(store, manager, buffer_bytes=settings.keeper_buffer_bytes,
                               link_from_host=settings.keeper_link == "host")
        self.pool = ResidentPool(forget=self.keepers.forget)
        self.hooks = hooks or TestHooks()
        self.metrics = Metrics()  # the daemon's one registry: every metric below joins it
        self.model_path = ModelPath(settings, gateway_url, store, manager, rewrite=self.hooks.rewrite_model_request,
                                    registry=self.metrics.registry)
        self.locks = MemberLocks()
        self.capacity_metrics = CapacityMetrics(self.metrics.registry)
        self.capacity = HostCapacity(settings, manager=manager, pool=self.pool, locks=self.locks,
                                     metrics=self.capacity_metrics, on_stopped=self.model_path.close)
        self.sweeps = Sweeps(store=store, capacity=self.capacity, retain_days=settings.retain_days)
        self.memory = ResidentMemory(settings.resident_memory_bytes(), pool=self.pool, locks=self.locks,
                                     registry=self.metrics.registry, refresh_s=settings.memory_refresh_s,
                                     pss_every_s=settings.memory_pss_every_s)
        self.launch_slots = LaunchSlots(settings.max_launches or default_slots(), self.metrics.registry)
        self.runner = TurnRunner(store=store, manager=manager, pool=self.pool, model_path=self.model_path,
                                 models=settings.models,
                                 turn_timeout_s=settings.turn_timeout_s,
                                 handshake_timeout_s=settings.handshake_timeout_s, hooks=self.hooks,
                                 driver_options=driver_options(settings, manager.config.pins),
                                 launch_gate=self.memory.launching, turn_gate=self.memory.turn_room,
                                 launch_slots=self.launch_slots,
                                 keepers=self.keepers)
        self.heartbeat = Heartbeat(interval_s=settings.heartbeat_interval_s)
        self.housekeeping = Housekeeping(settings, store=store, manager=manager, pool=self.pool, locks=self.locks,
                                         capacity=self.capacity, sweeps=self.sweeps, heartbeat=self.heartbeat)
        self.recovery = Recovery(store=store, manager=manager, runner=self.runner, pool=self.pool, locks=self.locks,
                                 metrics=self.metrics, owner=self.owner)
        self._jobs: dict[tuple[str, str], _Job] = {}
        self.deletions = ChatDeletions()
        self._tg: TaskGroup | None = None
        self.started_at = datetime.now(UTC)

    def in_turn(self, key: tuple[str, str, str]) -> bool:
        """A turn of this member holds its lock now (the inspector's host view)."""
        return self.locks.held(key)

    # -- lifecycle ----------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator["Supervisor"]:
        await self.store.open()  # PostgreSQL: connect and migrate (SQLite: already open)
        await self.capacity.load(self.store)
        async with anyio.create_task_group() as tg, self.model_path.running():
            # inside the model path: a turn being finished needs its socket back
            pending = await self.recovery.recover()
            # the proxy service may have outlived the last daemon: it forgets the turns no one finishes
            await self.model_path.keep_turns([p.job.job_id for p in pending])
            for p in pending:
                await tg.start(self.recovery.finish, p)  # holds the member's lock before any job is admitted
            self._tg = tg
            tg.start_soon(self.housekeeping.beat_loop)
            tg.start_soon(self.housekeeping.idle_loop)
            tg.start_soon(self.model_path.purge_loop)
            tg.start_soon(self.memory.loop)
            tg.start_soon(self.housekeeping.sweep_loop)
            tg.start_soon(self.manager.integrity.follow)  # keeps resident turns' integrity facts fresh
            try:
                yield self
            finally:
                with anyio.CancelScope(shield=True):
                    # SPEC 14: residents live on under their keepers; turns in flight are
                    # finished by the next daemon (ours end at once with Detached)
                    self.runner.detaching = True
                    await self.pool.detach_all()
                    await self._drain_jobs()
                    try:  # a turn whose reader left may have its commit still on its way to the disk
                        await self.store.sync()
                    except StoreUnavailable as exc:
                        log.warning("store.unsynced_at_shutdown", error=str(exc))
                tg.cancel_scope.cancel()
        self._tg = None

    async def _drain_jobs(self, timeout_s: float = 5.0) -> None:
        with anyio.move_on_after(timeout_s):
            for j in list(self._jobs.values()):
                await j.done.wait()

    # -- jobs ------------------------------------------------------------------------------------

    async def submit(self, job: Job) -> Submission:
        """Fence look-up, admission (may wait; ``busy`` at the queue timeout), then the fence's
        claim. Nothing durable is written before admission (runner.admission).

        A job the host admits at once skips the look-up: the claim answers a repeat the same
        way (one store round trip per turn fewer). The look-up is there for the others, so a
        repeat is answered at once rather than after a wait in the queue."""
        if self._tg is None:
            raise RuntimeError("supervisor is not running")
        if self.hooks.turn_trace is not None:  # bench mode only
            self.hooks.turn_trace(turn_trace.begin(job.job_id))
        if not self.capacity.admission.admits_at_once((job.user_id, job.chat_id)):
            seen = await self.store.get_job(job.user_id, job.job_id)
            mark("fence_read")
            if seen is not None:
                return _repeat(seen.body_digest != job.digest(), seen.receipt_json)
        if self.capacity.admission.position_of(job.user_id, job.job_id) is not None:
            return Submission("running")  # the same job id is already waiting for admission
        stream = JobStream(self.settings.event_buffer_bytes)
        try:
            grant = await self.capacity.admit(job.user_id, job.chat_id, job.job_id, stream)
        except HostBusy as busy:
            log.info("job.host_busy", job_id=job.job_id, waited_ms=busy.waited_ms, position=busy.position)
            return Submission("busy", busy=busy)
        mark("admitted")
        # the claim reads the member too: under the member's lock the turn takes that read when
        # no turn (or fork, or deletion) of the member ended since (runner.member_locks)
        sighting = self.locks.sight((job.user_id, job.chat_id, job.member_id))
        try:
            # flushed beside the turn's preparation, before the CLI's input (runner.claim_on_disk)
            claim = await self.store.claim_job(job.job_id, job.user_id, job.chat_id, job.member_id, job.digest(),
                                               self.owner, sync=False, read_member=True, read_sandbox=True)
        except BaseException:
            self.locks.unsight(sighting)
            self.capacity.release(grant)
            raise
        mark("claimed")
        if claim.kind != "claimed":
            self.locks.unsight(sighting)
            self.capacity.release(grant)  # dispatched twice while queued: the first one won
            assert claim.job is not None
            return _repeat(claim.kind == "conflict", claim.job.receipt_json)
        entry = _Job(job=job, stream=stream, grant=grant, claimed_member=claim.member, sighting=sighting,
                     claimed_sandbox=claim.sandbox)
        self._jobs[(job.user_id, job.job_id)] = entry
        self._tg.start_soon(self._run_job, entry)
        return Submission("started", events=stream)

    async def _run_job(self, entry: _Job) -> None:
        job = entry.job
        last: dict[str, Any] = {"type": "error", "error": "internal_error", "detail": "cancelled"}
        try:
            with entry.scope:
                on_disk = ClaimOnDisk()
                receipt = await alongside(lambda: on_disk.flush(self.store.sync), lambda: self._turn(entry, on_disk))
            if entry.scope.cancelled_caught:
                receipt = await self._close_cancelled(job)
            entry.receipt = receipt
            self.metrics.observe(receipt)
            last = {"type": "receipt", "receipt": receipt.model_dump(mode="json")}
        except Detached:
            log.info("job.left_to_next_daemon", job_id=job.job_id)
            last = {"type": "error", "error": "daemon_restarting",
                    "detail": "the daemon stopped during the turn; the next one finishes it (GET the job)"}
        except Fenced:
            # the lease expired mid-turn: the store refused the commit; nothing was recorded
            log.error("job.commit_fenced", job_id=job.job_id)
            await self.pool.retire_where(lambda r: r.key[:2] == (job.user_id, job.chat_id), "host fenced")
            last = {"type": "error", "error": "host_fenced",
                    "detail": "this host's lease expired during the turn: the store refused its commit"}
        except StoreUnavailable as exc:
            # The store went away mid-turn: close the job as not_settled (the store retries a
            # while) so it is not left running; the member's locator stays where it was.
            log.error("job.store_unavailable", job_id=job.job_id, error=str(exc))
            await self.pool.retire_where(lambda r: r.key == (job.user_id, job.chat_id, job.member_id),
                                         "store unavailable")
            try:
                entry.receipt = await close_unsettled(self.store, job, "store_unavailable")
                last = {"type": "receipt", "receipt": entry.receipt.model_dump(mode="json")}
            except (StoreUnavailable, RuntimeError, KeyError):
                last = {"type": "error", "error": "store_unavailable", "detail": str(exc)}
        except Exception as exc:  # noqa: BLE001 - a bug must not take the daemon down
            log.exception("job.crashed", job_id=job.job_id, error=repr(exc))
            last = {"type": "error", "error": "internal_error", "detail": type(exc).__name__}
        finally:
            self.locks.unsight(entry.sighting)  # idempotent: a job cancelled before it took the lock
            self.capacity.release(entry.grant)
            self.memory.notify()  # its resident is idle now: a waiting launch may retire it
            entry.done.set()
            entry.stream.finish(last)
            mark("receipt_framed")
            self._jobs.pop((job.user_id, job.job_id), None)

    async def _turn(self, entry: _Job, on_disk: ClaimOnDisk) -> Receipt:
        job = entry.job
        # a job that came while its chat is being deleted runs after it, on the new chat
        await self.deletions.wait_clear((job.user_id, job.chat_id))
        await self.capacity.make_room(entry.grant)
        mark("room_made")
        async with self.locks.hold((job.user_id, job.chat_id, job.member_id)):
            mark("locked")
            return await self.runner.execute(job, entry.stream.emit, claim_on_disk=on_disk.wait,
                                             member=self._claimed_member(entry), sandbox=entry.claimed_sandbox)

    def _claimed_member(self, entry: _Job) -> KnownMember | None:
        """Under the member's lock: the claim's read of the member, unless it may be stale."""
        self.locks.unsight(entry.sighting)
        return None if entry.sighting.spoiled else KnownMember(entry.claimed_member)

    async def _close_cancelled(self, job: Job) -> Receipt:
        """A job its chat's deletion cancelled: the receipt the turn committed as it was
        cancelled, or (cancelled before its turn ran) a not_settled one saying why."""
        rec = await self.store.get_job(job.user_id, job.job_id)
        if rec is not None and rec.receipt_json is not None:
            return Receipt.model_validate_json(rec.receipt_json)
        return await close_unsettled(self.store, job, CHAT_DELETED)

    async def run_job(self, job: Job) -> tuple[Receipt | None, list[dict[str, Any]], str]:
        """Library call: dispatch and wait. Returns (receipt, events, submission kind)."""
        sub = await self.submit(job)
        if sub.kind != "started":
            return sub.receipt, [], sub.kind
        events: list[dict[str, Any]] = []
        assert sub.events is not None
        async for ev in sub.events.events():
            events.append(ev)
        receipt = next((Receipt.model_validate(e["receipt"]) for e in events if e.get("type") == "receipt"), None)
        return receipt, events, sub.kind

    async def get_receipt(self, job_id: str, user_id: str) -> Receipt | Literal["running"] | int | None:
        """The receipt, "running", the queue position (an int) of a job waiting for admission, or None."""
        rec = await self.store.get_job(user_id, job_id)
        if rec is None:
            # another user's job is indistinguishable from a missing one
            return self.capacity.admission.position_of(user_id, job_id)
        if rec.receipt_json is None:
            return "running"
        return Receipt.model_validate_json(rec.receipt_json)

    # -- chat operations ------------------------------------------------------------------------

    async def chat_status(self, user_id: str, chat_id: str) -> dict[str, Any] | None:
        return await chat_status(self.store, self.pool, self.sweeps, user_id, chat_id)

    async def render_metrics(self, accept: str = "") -> tuple[bytes, str]:
        """The Prometheus exposition (in the format ``accept`` asks for) and its content type."""
        await self.model_path.refresh_metrics()  # the proxy service's counters, relayed
        states: dict[str, int] = {s.value: 0 for s in SandboxState}
        for rec in await self.store.list_sandboxes():
            if rec.host_id == self.manager.config.host_id:
                states[rec.state.value] += 1
        return self.metrics.render(residents=sum(1 for k in self.pool.keys() if self.pool.is_resident(k)),
                                   sandboxes=states, accept=accept)

    async def stop_chat(self, user_id: str, chat_id: str) -> bool:
        chat_keys = self.locks.chat_keys(user_id, chat_id)
        sb = await self.store.get_sandbox(user_id, chat_id)
        if sb is None:
            return False
        async with self.locks.hold_all(chat_keys):
            await self.pool.retire_where(lambda r: r.key[:2] == (user_id, chat_id), "chat stop")
            stopped = await self.manager.stop(user_id, chat_id)
            await self.model_path.close(user_id, chat_id)
            return stopped

    async def delete_chat(self, user_id: str, chat_id: str) -> ChatDeleted | None:
        """Delete a chat (runner.chat_deletion); None: no such chat of this user. Deleting a
        deleted chat again removes nothing."""
        if not await self.store.chat_known(user_id, chat_id):
            return None
        return await delete_chat(self, user_id, chat_id)

    def jobs_of_chat(self, chat: tuple[str, str]) -> list[_Job]:
        return [e for e in self._jobs.values() if (e.job.user_id, e.job.chat_id) == chat]

    async def fork(self, user_id: str, chat_id: str, member_id: str, req: ForkRequest) -> dict[str, Any]:
        """A new member whose native session is a fork (raises ForkError with a status)."""
        forker = Forker(self.store, self.manager, self.pool, self.runner)
        source = await forker.check(await self.store.get_member(user_id, chat_id, member_id), req)
        async with self.locks.hold_all([(user_id, chat_id, member_id), (user_id, chat_id, req.new_member_id)]):
            source = await forker.check(await self.store.get_member(user_id, chat_id, member_id), req)
            return await forker.fork(source, req)

    async def retire_member(self, user_id: str, chat_id: str, member_id: str) -> bool | None:
        if await self.store.get_member(user_id, chat_id, member_id) is None:
            return None
        key = (user_id, chat_id, member_id)
        async with self.locks.hold(key):
            return await self.pool.retire(key, "retire requested")


def _repeat(conflict: bool, receipt_json: str | None) -> Submission:
    """The answer to a job id the fence has seen: conflict, its receipt, or still running."""
    if conflict:
        return Submission("conflict")
    if receipt_json is not None:
        return Submission("done", receipt=Receipt.model_validate_json(receipt_json))
    return Submission("running")


def build_supervisor(settings: Settings, gateway_url: str, *, hooks: TestHooks | None = None,
                     engine: Engine | None = None) -> Supervisor:
    engine = engine or DockerEngine(settings.docker_url)
    store = open_store(settings.store_url.get_secret_value() if settings.store_url else None, settings.store_path)
    image = settings.image or image_tag()
    pins = hooks.pins if hooks is not None else None  # an upgrade test's pins file; else images/pins.toml
    cfg = SandboxConfig(image=image, socket_root=str(settings.check_socket_root()),
                        host_id=settings.resolved_host_id(), memory_bytes=settings.memory_bytes,
                        pids_limit=settings.pids_limit, nano_cpus=settings.nano_cpus,
                        disk_bytes=None if settings.sandbox_disk_mb is None else settings.sandbox_disk_mb * 1024 * 1024,
                        require_helper=carries_bridge(pins or load_pins()), pins=pins)
    manager = SandboxManager(engine, store, cfg)
    return Supervisor(settings, engine=engine, store=store, manager=manager, gateway_url=gateway_url, hooks=hooks)
