"""The turn state machine (SPEC sections 3-5 and 8).

validate -> (fence, in the supervisor) -> member checks -> resolve the sandbox ->
decide NEW / LIVE / RESTORED / LOST -> refuse LOST -> run the turn through the driver ->
verify identity at settlement -> commit -> retire when asked or when not settled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
import structlog

from drivers.base import Driver, Launch
from drivers.models import (
    DriverOptions,
    FailureReason,
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    NotSettled,
    NotSettledReason,
    Settlement,
)
from drivers.registry import get_driver
from drivers.session import NativeSession, TurnStart
from drivers.transport import Transport
from images.pins import Pins, cli_version_from_labels, load_pins
from runner.processes import member_paths, start_in_sandbox
from runner.keepers import Keepers
from runner.residents import Resident, ResidentPool
from runner.model_path import ModelPath
from runner.transport import exec_transport
from sandbox_manager.keeper import KeeperError
from sandbox_manager.sandboxes import (
    ImageRefused,
    ModelGateNotReady,
    Sandbox,
    SandboxLost,
    SandboxManager,
    SandboxRefused,
)
from state.jobs import Job
from state.contract import VerifiedIn
from state.keepers import KeeperTurn
from state.receipts import ContextStatus, Outcome, Receipt, SandboxInfo, SettlementInfo, Timings, UpgradedFrom
from state.records import MemberRecord, SandboxState, SavedLocator
from state.store import MemberOutcome, Store, VerifiedTurn
from telemetry.turn_trace import TurnTrace, mark

log = structlog.get_logger("turn")

Emit = Callable[[dict[str, Any]], None]
LaunchGate = Callable[[tuple[str, str, str], str], AbstractAsyncContextManager[None]]


@dataclass
class TestHooks:
    """Test-only seams. Never set in production (the daemon has no way to set them)."""

    wrap_transport: Callable[[Transport, str], Transport] | None = None
    disable_retire_after: bool = False
    lease_paused: Callable[[], bool] | None = None  # a fleet host's heartbeat pauses while True
    # the model proxy rewrites a request body before auditing and forwarding it (route name, body)
    rewrite_model_request: Callable[[str, bytes], bytes] | None = None
    # bench mode (issue 16): each submitted job gets a TurnTrace of per-phase marks, handed here
    turn_trace: Callable[[TurnTrace], None] | None = None
    # the pins the configured image must carry (an upgrade test's second pins file, SPEC 15);
    # the product's own are images/pins.toml
    pins: Pins | None = None


def to_locator(saved: SavedLocator | None) -> Locator | None:
    return None if saved is None else Locator(id=saved.id, path=saved.path)


def to_saved(loc: Locator) -> SavedLocator:
    return SavedLocator(id=loc.id, path=loc.path)


def is_new(member: MemberRecord) -> bool:
    """NEW: no native turn of this member's own session has settled (a lazy fork's session
    comes into being at its first turn, whatever history it inherits)."""
    return member.settled_turns == 0 or member.pending_fork is not None


def serves(resident: Resident, saved: SavedLocator | None, container_id: str) -> bool:
    """LIVE: the resident process is alive, on the saved locator, in the chat's container."""
    return (resident.alive and saved is not None and resident.locator is not None
            and resident.locator.id == saved.id and resident.container_id == container_id)


class Refusal(Exception):
    """Execution refused before any message reached a CLI.

    ``sticky``: the member's native state is lost for good (a LOST member stays LOST); a job
    that merely names the wrong locator is refused without condemning the member.
    """

    def __init__(self, reason: str, status: ContextStatus | None = ContextStatus.LOST, *, sticky: bool = True,
                 detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
        self.status = status
        self.sticky = sticky and status == ContextStatus.LOST


@dataclass
class TurnContext:
    job: Job
    emit: Emit
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    t0: float = field(default_factory=time.monotonic)
    timings: Timings = field(default_factory=Timings)
    status: ContextStatus | None = None
    sandbox: Sandbox | None = None
    member: MemberRecord | None = None
    cli_version: str | None = None
    compacted: bool = False  # the driver saw the CLI's own compaction in this turn
    # SPEC 15: the member's native state was last verified in another container / on another image
    recreated: bool = False
    upgraded_from: UpgradedFrom | None = None

    def ms_since(self, t: float) -> int:
        return int((time.monotonic() - t) * 1000)


class TurnRunner:
    def __init__(self, *, store: Store, manager: SandboxManager, pool: ResidentPool, model_path: ModelPath,
                 models: dict[str, str], turn_timeout_s: float, handshake_timeout_s: float,
                 hooks: TestHooks | None = None, driver_options: DriverOptions | None = None,
                 launch_gate: LaunchGate | None = None, keepers: Keepers | None = None,
                 drivers: Callable[[str, DriverOptions | None], Driver] = get_driver) -> None:
        self.store = store
        self.keepers = keepers  # residents run under in-sandbox keepers (SPEC 14); None: plain execs
        # daemon shutdown: turns in flight are left to the next daemon (never committed or retired here)
        self.detaching = False
        self.manager = manager
        self.pool = pool
        self.model_path = model_path
        self.models = models
        self.turn_timeout_s = turn_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self.hooks = hooks or TestHooks()
        self.driver_options = driver_options or DriverOptions(helper_version=load_pins().helper.version)
        # Capacity: waits until a new resident may start (the memory budget) and holds its
        # place until the resident is in the pool.
        self.launch_gate = launch_gate
        # (user_id, job_id) -> why a turn is being cancelled (its receipt's reason), e.g. chat_deleted
        self.cancel_reasons: dict[tuple[str, str], str] = {}
        self.drivers = drivers  # (runtime, launch inputs) -> driver: the registry

    def driver(self, runtime: str) -> Driver:
        """The runtime's driver with this host's launch inputs (pins, compaction policy)."""
        return self.drivers(runtime, self.driver_options)

    def gateway(self, runtime: str, user_id: str, chat_id: str, member_id: str) -> GatewayConfig:
        """The member's own base URL through its sandbox's model socket, and a placeholder key."""
        return self.model_path.gateway(user_id, chat_id, member_id, self.models[runtime])

    async def resolve_sandbox(self, user_id: str, chat_id: str, *, resident: bool = False) -> Sandbox:
        """The chat's sandbox with its model socket listening (opened first: the container's
        command connects to it as it starts). A lost sandbox's socket is closed again.
        ``resident``: a live resident serves the turn (its checks may come from fresh facts)."""
        await self.model_path.open(user_id, chat_id)
        mark("model_socket")
        try:
            return await self.manager.resolve(user_id, chat_id, resident=resident,
                                              before_replace=self.retire_container)
        except (SandboxLost, ImageRefused, ModelGateNotReady):
            await self.model_path.close(user_id, chat_id)
            raise

    # -- receipts ---------------------------------------------------------------------------------

    def _receipt(self, ctx: TurnContext, outcome: Outcome, *, reason: str | None = None,
                 settlement: Settlement | None = None, text: str = "", locator_after: str | None = None,
                 detail: str | None = None) -> Receipt:
        job = ctx.job
        ctx.timings.total = ctx.ms_since(ctx.t0)
        sb = ctx.sandbox
        cli_version = ctx.cli_version or (cli_version_from_labels(sb.image.labels, job.runtime) if sb else None)
        info = SettlementInfo()
        if settlement is not None:
            info = SettlementInfo(evidence=settlement.evidence, is_error=settlement.is_error,
                                  compacted=settlement.compacted,
                                  detail=settlement.detail, raw=settlement.raw)
        elif detail:
            info = SettlementInfo(detail=detail)
        before = ctx.member.locator.id if ctx.member and ctx.member.locator else None
        receipt = Receipt(
            job_id=job.job_id, user_id=job.user_id, chat_id=job.chat_id, member_id=job.member_id,
            runtime=job.runtime, context_status=ctx.status, outcome=outcome, reason=reason,
            locator_before=before, locator_after=locator_after if locator_after is not None else before,
            settlement=info, assistant_text=text,
            sandbox=SandboxInfo(container_id=sb.container_id if sb else None, image_id=sb.image.id if sb else None,
                                helper_version=sb.helper_version if sb else None, volume=sb.volume if sb else None,
                                recreated=ctx.recreated),
            cli_version=cli_version or load_pins().cli[job.runtime].version, upgraded_from=ctx.upgraded_from,
            timings_ms=ctx.timings, started_at=ctx.started_at, finished_at=datetime.now(UTC),
        )
        mark("receipt_built")
        return receipt

    async def _commit(self, ctx: TurnContext, receipt: Receipt, verified: Locator | None) -> Receipt:
        with anyio.CancelScope(shield=True):
            settled = (ctx.member.settled_turns if ctx.member else 0) + (1 if verified is not None else 0)
            wire, row = await self.model_path.settle(receipt, ctx.member, message=ctx.job.message,
                                                     compaction=ctx.compacted, settled_index=settled)
        mark("wire_settled")
        receipt = receipt.model_copy(update={"wire": wire})
        where = VerifiedIn(container_id=receipt.sandbox.container_id, image_id=receipt.sandbox.image_id,
                           cli_version=receipt.cli_version)
        member = MemberOutcome(
            last_status=receipt.context_status.value if receipt.context_status else "-",
            last_outcome=receipt.outcome.value,
            verified=VerifiedTurn(to_saved(verified), where) if verified is not None else None,
            wire=row,
        )
        with anyio.CancelScope(shield=True):
            await self.store.finish_job(receipt.user_id, receipt.job_id, receipt.model_dump_json(), member)
        mark("committed")
        log.info("turn.committed", job_id=receipt.job_id, runtime=receipt.runtime,
                 status=receipt.context_status, outcome=receipt.outcome, reason=receipt.reason,
                 total_ms=receipt.timings_ms.total, wire=wire.history)
        return receipt

    # -- the state machine ---------------------------------------------------------------------------

    async def execute(self, job: Job, emit: Emit) -> Receipt:
        ctx = TurnContext(job=job, emit=emit)
        key = (job.user_id, job.chat_id, job.member_id)
        self.model_path.begin(job)
        try:
            return await self._execute(ctx, key)
        finally:
            self.model_path.end(job)
            if ctx.sandbox is not None:
                self.manager.release(ctx.sandbox)  # a replacement by another member may go on

    async def retire_container(self, container_id: str) -> None:
        """Before a replacement removes a container: its resident processes are retired."""
        await self.pool.retire_where(lambda r: r.container_id == container_id, "sandbox replaced")

    async def finish(self, job: Job, turn: KeeperTurn) -> Receipt:
        """SPEC 14: finish a turn the previous daemon began on a re-adopted keeper: re-read its
        output from the offset where it began through the driver's tracker, settle it on the
        CLI's own evidence, verify identity and commit once (the job is still ``running``)."""
        key = (job.user_id, job.chat_id, job.member_id)
        ctx = TurnContext(job=job, emit=lambda event: None, started_at=turn.started_at,
                          timings=Timings.model_validate_json(turn.timings_json),
                          status=ContextStatus(turn.context_status) if turn.context_status else None)
        self.model_path.begin(job)  # the CLI's retried model request belongs to this job
        try:
            ctx.member = await self.store.get_member(*key)
            resident = self.pool.get(key)
            try:
                ctx.sandbox = await self.resolve_sandbox(job.user_id, job.chat_id)
            except (SandboxLost, ImageRefused, ModelGateNotReady) as exc:
                await self.pool.retire(key, "sandbox lost before finishing")
                return await self._commit(ctx, self._receipt(ctx, Outcome.NOT_SETTLED, reason="daemon_restarted",
                                                             detail=str(exc)), None)
            if resident is None or resident.keeper is None:
                return await self._commit(ctx, self._receipt(ctx, Outcome.NOT_SETTLED, reason="daemon_restarted",
                                                             detail="the keeper was not re-adopted"), None)
            session, channel = resident.session, resident.keeper.channel
            ctx.cli_version = session.cli_version
            seen = channel.hello.written  # output the previous daemon may have read (and answered)
            return await self._run(ctx, key, session, resume=session.load_start(turn.start_json),
                                   answer=lambda: channel.offset > seen)
        finally:
            self.model_path.end(job)
            if ctx.sandbox is not None:
                self.manager.release(ctx.sandbox)

    async def _execute(self, ctx: TurnContext, key: tuple[str, str, str]) -> Receipt:
        emit = ctx.emit
        try:
            session = await self._prepare(ctx, key)
        except Refusal as r:
            ctx.status = r.status
            receipt = self._receipt(ctx, Outcome.REFUSED, reason=r.reason, detail=r.detail or None)
            if r.sticky and ctx.member is not None:
                await self.store.mark_member_lost(*key, r.reason)
            return await self._commit(ctx, receipt, None)
        except _NotStarted as ns:
            return await self._commit(ctx, self._receipt(ctx, Outcome.NOT_SETTLED, reason=ns.reason,
                                                         detail=ns.detail), None)
        emit({"type": "status", "context_status": ctx.status.value if ctx.status else None})
        mark("status_emitted")
        return await self._run(ctx, key, session)

    async def _prepare(self, ctx: TurnContext, key: tuple[str, str, str]) -> NativeSession:
        job = ctx.job
        member = await self.store.get_member(*key)
        mark("member_read")
        ctx.member = member
        if member is not None and member.runtime != job.runtime:
            raise Refusal("runtime_mismatch", status=None, sticky=False)
        saved = member.locator if member else None
        # Identity rule 2: a requested locator must equal the saved one; checked before launch.
        # The member is not condemned: the receipt says what its next turn would be (SPEC 3).
        if job.locator is not None and (saved is None or job.locator != saved.id):
            raise Refusal("locator_mismatch", status=await self._standing(member, key), sticky=False)
        if member is not None and member.lost_reason is not None:
            raise Refusal("previously_lost")  # a LOST member stays LOST
        # Identity rule 3: settled turns but no resume locator (an unstarted lazy fork has none yet).
        if member is not None and member.settled_turns > 0 and saved is None and member.pending_fork is None:
            raise Refusal("member_locator_missing")
        t = time.monotonic()
        resident = self.pool.get(key)
        try:
            ctx.sandbox = await self.resolve_sandbox(job.user_id, job.chat_id,
                                                     resident=resident is not None and resident.alive)
        except ModelGateNotReady as exc:
            ctx.timings.sandbox = ctx.ms_since(t)
            raise _NotStarted("model_gate_not_ready", str(exc)) from None
        except SandboxLost as lost:
            await self.pool.retire_where(lambda r: r.key[:2] == key[:2], "sandbox lost")
            ctx.timings.sandbox = ctx.ms_since(t)
            raise Refusal(lost.reason.value, detail=lost.detail) from None
        except SandboxRefused as refused:
            ctx.timings.sandbox = ctx.ms_since(t)
            raise Refusal(refused.reason, status=None, sticky=False) from None  # the member is intact
        except ImageRefused as exc:
            ctx.timings.sandbox = ctx.ms_since(t)
            log.error("turn.image_refused", detail=str(exc))
            # the host's configured image is at fault; the chat's native state is intact
            raise Refusal("image_unsupported", sticky=False) from None
        ctx.timings.sandbox = ctx.ms_since(t)
        self._note_replacement(ctx)
        if member is None:
            member = await self.store.ensure_member(*key, job.runtime)
            ctx.member = member
        t = time.monotonic()
        resident = self.pool.get(key)  # again: resolving may have retired it
        if resident is not None and serves(resident, saved, ctx.sandbox.container_id):
            ctx.status = ContextStatus.LIVE
            ctx.cli_version = resident.session.cli_version
            resident.last_used = time.monotonic()
            ctx.timings.process = ctx.ms_since(t)
            mark("process_ready")
            return resident.session
        if resident is not None:
            await self.pool.retire(key, "stale before turn")
        ctx.status = ContextStatus.NEW if is_new(member) else ContextStatus.RESTORED
        resume = to_locator(saved) if ctx.status == ContextStatus.RESTORED else None
        session = await self._launch(ctx, key, resume)
        ctx.timings.process = ctx.ms_since(t)
        mark("process_ready")
        return session

    async def _standing(self, member: MemberRecord | None, key: tuple[str, str, str]) -> ContextStatus:
        """The status the member's next turn would have, read from its record, the resident pool
        and the sandbox record only: a refused job starts nothing and changes nothing."""
        sandbox = await self.store.get_sandbox(*key[:2])
        if sandbox is not None and sandbox.state == SandboxState.LOST:
            return ContextStatus.LOST
        if member is None:
            return ContextStatus.NEW
        if member.lost_reason is not None:
            return ContextStatus.LOST
        if is_new(member):
            return ContextStatus.NEW
        if member.locator is None:
            return ContextStatus.LOST
        resident = self.pool.get(key)
        if resident is not None and sandbox is not None and serves(resident, member.locator, sandbox.container_id):
            return ContextStatus.LIVE
        return ContextStatus.RESTORED

    @staticmethod
    def _note_replacement(ctx: TurnContext) -> None:
        """SPEC 15: where the member's native state was last verified, against where it is now."""
        m, sb = ctx.member, ctx.sandbox
        if m is None or sb is None:
            return
        ctx.recreated = m.last_container_id is not None and m.last_container_id != sb.container_id
        if m.last_image_id is not None and m.last_image_id != sb.image.id:
            ctx.upgraded_from = UpgradedFrom(image_id=m.last_image_id, cli_version=m.last_cli_version)

    async def _launch(self, ctx: TurnContext, key: tuple[str, str, str], resume: Locator | None) -> NativeSession:
        job, sandbox = ctx.job, ctx.sandbox
        assert sandbox is not None
        driver = self.driver(job.runtime)
        assert ctx.member is not None
        dirs = self.manager.member_dirs(ctx.member.home_member_id)
        gateway = self.gateway(job.runtime, job.user_id, job.chat_id, job.member_id)
        pending = ctx.member.pending_fork
        if resume is None and pending is not None:
            # A fork the CLI makes itself as this first turn starts (Claude --fork-session).
            parent = to_locator(pending.parent)
            assert parent is not None
            launch: Launch = driver.plan_fork(member_paths(dirs), gateway, parent, pending.at_turn)
        else:
            launch = driver.plan(member_paths(dirs), gateway, resume)
        keepers = self.keepers
        host_init_pid = sandbox.container.attrs.get("State", {}).get("Pid") or None
        async with self.launch_gate(key, job.runtime) if self.launch_gate else nullcontext():
            if keepers is not None:
                try:
                    handle = await keepers.start(sandbox, dirs, launch, job.member_id)
                    mark("attached")
                except KeeperError as exc:
                    raise _NotStarted("keeper_unavailable", str(exc)) from None
                transport: Transport = exec_transport(handle.channel)
                if self.hooks.wrap_transport is not None:
                    transport = self.hooks.wrap_transport(transport, job.runtime)
                session = driver.session(transport, launch)
                resident = Resident(key=key, runtime=job.runtime, session=session, container_id=sandbox.container_id,
                                    pidfile=handle.paths.pidfile,  # the keeper's group: it and the CLI's tree below it
                                    kill=lambda: keepers.kill(handle.container_id, handle.run_dir),
                                    aclose=handle.channel.detach, keeper=handle, host_init_pid=host_init_pid)
            else:
                proc = await start_in_sandbox(self.manager, sandbox, dirs, launch)
                mark("attached")
                transport = exec_transport(proc.stream)
                if self.hooks.wrap_transport is not None:
                    transport = self.hooks.wrap_transport(transport, job.runtime)
                session = driver.session(transport, launch)
                resident = Resident(key=key, runtime=job.runtime, session=session, container_id=sandbox.container_id,
                                    pidfile=proc.pidfile,
                                    kill=lambda: self.manager.kill_group(proc.container_id, proc.pidfile),
                                    aclose=proc.stream.aclose, host_init_pid=host_init_pid)
            self.pool.add(resident)
        try:
            with anyio.fail_after(self.handshake_timeout_s):
                await session.handshake()
        except HandshakeFailed as hf:
            await self.pool.retire(key, f"handshake failed: {hf.reason.value}")
            if hf.reason == HandshakeReason.HELPER_VERSION:
                raise Refusal(hf.reason.value, status=ContextStatus.LOST if launch.resume else ctx.status) from None
            if launch.resume and hf.reason in (HandshakeReason.NATIVE_STATE_MISSING, HandshakeReason.LOCATOR_MISMATCH):
                # SPEC 15: the current image's CLI cannot confirm the locator saved on another image
                if ctx.upgraded_from is not None:
                    raise Refusal("upgrade_incompatible", detail=f"{hf.reason.value}: {hf.detail}") from None
                raise Refusal(hf.reason.value) from None
            raise _NotStarted(f"handshake_{hf.reason.value}", hf.detail) from None
        except TimeoutError:
            await self.pool.retire(key, "handshake timeout")
            raise _NotStarted("handshake_timeout", f"no handshake within {self.handshake_timeout_s}s") from None
        except BaseException:
            await self.pool.retire(key, "launch interrupted")
            raise
        ctx.cli_version = session.cli_version
        mark("handshake")
        if resident.keeper is not None and keepers is not None:
            await keepers.settle(key, job.runtime, resident.keeper, session)
        return session

    async def _run(self, ctx: TurnContext, key: tuple[str, str, str], session: NativeSession, *,
                   resume: TurnStart | None = None, answer: Callable[[], bool] | None = None) -> Receipt:
        """Run the turn (or, with ``resume``, finish one a previous daemon began: SPEC 14)."""
        job = ctx.job
        if ctx.status == ContextStatus.NEW:
            expected = session.expected or session.locator  # what the NEW handshake established
        else:
            expected = to_locator(ctx.member.locator)

        first = True

        def forward(event: Any) -> None:
            nonlocal first
            if first:
                first = False
                mark("first_event")
            ctx.emit({"type": "event", **event.model_dump(exclude={"raw"})})

        resident = self.pool.get(key)
        keepers = self.keepers
        if resident is not None and resident.keeper is not None and keepers is not None:
            handle, t_ctx = resident.keeper, ctx

            async def record_start(start: TurnStart) -> None:
                await keepers.begin_turn(key, job.runtime, handle, session, job, start, status=t_ctx.status,
                                         started_at=t_ctx.started_at, timings=t_ctx.timings)

            session.before_turn = record_start
        t = time.monotonic()
        outcome: Settlement | NotSettled
        try:
            # The driver enforces the turn timeout itself (native interrupt first); this outer
            # scope only guards against a driver that fails to.
            with anyio.move_on_after(self.turn_timeout_s + 30) as watchdog:
                if resume is not None:
                    outcome = await session.resume_turn(resume, emit=forward, timeout_s=self.turn_timeout_s,
                                                        answer=answer or (lambda: True))
                else:
                    outcome = await session.run_turn(job.message, emit=forward, timeout_s=self.turn_timeout_s)
            if watchdog.cancelled_caught:
                outcome = NotSettled(reason=NotSettledReason.TIMEOUT, detail="runner watchdog")
        except BaseException:
            if self.detaching and resident is not None and resident.keeper is not None:
                raise  # the keeper keeps the turn's output; the next daemon finishes it
            with anyio.CancelScope(shield=True):
                await self.pool.retire(key, "turn cancelled")
                why = self.cancel_reasons.get((job.user_id, job.job_id), "cancelled")
                receipt = self._receipt(ctx, Outcome.NOT_SETTLED, reason=why)
                await self._commit(ctx, receipt, None)
            raise
        if self.detaching and resident is not None and resident.keeper is not None:
            raise Detached(job.job_id)  # our attach ended under the turn: not its outcome
        ctx.timings.turn = ctx.ms_since(t)
        mark("settled")
        if self.pool.get(key) is not None:
            self.pool.get(key).last_used = time.monotonic()
        ctx.compacted = bool(getattr(outcome, "compacted", False))
        if isinstance(outcome, NotSettled):
            await self.pool.retire(key, f"not settled: {outcome.reason.value}")
            receipt = self._receipt(ctx, Outcome.NOT_SETTLED, reason=outcome.reason.value, text=outcome.assistant_text,
                                    detail=outcome.detail)
            return await self._commit(ctx, receipt, None)
        observed = outcome.observed_locator
        if expected is None and ctx.status == ContextStatus.NEW:
            expected = observed  # the CLI minted it; nothing earlier to compare against
        if observed is None or expected is None or observed != expected:
            # Identity rule 1: a continuation reporting another id fails; nothing is saved.
            await self.pool.retire(key, "identity mismatch")
            detail = f"expected {expected}, CLI reported {observed}"
            receipt = self._receipt(ctx, Outcome.FAILED, reason=FailureReason.IDENTITY_MISMATCH.value,
                                    settlement=outcome.model_copy(update={"detail": detail}),
                                    text=outcome.assistant_text)
            return await self._commit(ctx, receipt, None)
        session.locator = observed
        result = Outcome.FAILED if outcome.is_error else Outcome.SUCCEEDED
        reason = (outcome.reason.value if outcome.reason else "api_error") if outcome.is_error else None
        receipt = self._receipt(ctx, result, reason=reason, settlement=outcome, text=outcome.assistant_text,
                                locator_after=observed.id)
        receipt = await self._commit(ctx, receipt, observed)
        current = self.pool.get(key)
        if current is not None and current.keeper is not None and keepers is not None:
            try:
                await keepers.settle(key, job.runtime, current.keeper, session)
            except Exception as exc:  # noqa: BLE001 - committed already; an unrecorded keeper retires
                log.warning("keeper.settle_failed", job_id=job.job_id, error=repr(exc))
                await self.pool.retire(key, "keeper record failed")
        if outcome.retire_after and not self.hooks.disable_retire_after:
            # SPEC section 6: after a Claude api_retry, save the verified locator, then retire.
            await self.pool.retire(key, "retire_after (api_retry seen)")
        return receipt


class Detached(Exception):
    """The daemon is shutting down under a turn that runs on under its keeper (SPEC 14)."""


class _NotStarted(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
