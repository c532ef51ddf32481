"""The turn state machine (SPEC sections 3-5 and 8).

validate -> (fence, in the supervisor) -> member checks -> resolve the sandbox ->
decide NEW / LIVE / RESTORED / LOST -> refuse LOST -> run the turn through the driver ->
verify identity at settlement -> commit -> retire when asked or when not settled.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import nullcontext
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
from images.pins import load_pins
from runner.alongside import alongside
from runner.processes import member_paths, start_in_sandbox
from runner.keepers import Keepers
from runner.launch_slots import LaunchSlots
from runner.hooks import TestHooks
from runner.residents import Resident, ResidentPool
from runner.stale_facts import RunAgain, recheck
from runner.model_path import ModelPath
from runner.transport import exec_transport
from runner.turn_commit import commit_turn
from runner.turn_context import (
    Detached,
    Emit,
    InputNotReady,
    KnownMember,
    LaunchGate,
    TurnGate,
    NotStarted,
    Refusal,
    TurnContext,
    build_receipt,
    is_new,
    note_replacement,
    serves,
    standing,
    to_locator,
)
from sandbox_manager.chat_containers import ImageRefused
from sandbox_manager.disk_bound import SandboxRefused
from sandbox_manager.identity import SandboxLost
from sandbox_manager.keeper_errors import KeeperError
from sandbox_manager.member_processes import MemberDirs
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.sealing import ModelGateNotReady
from state.jobs import Job
from state.keepers import KeeperRecord, KeeperTurn
from state.receipts import ContextStatus, Outcome, Receipt, Timings
from state.records import MemberRecord
from state.sandbox_writes import SeenSandbox
from state.store import Store
from telemetry.turn_trace import mark

log = structlog.get_logger("turn")


class TurnRunner:
    def __init__(self, *, store: Store, manager: SandboxManager, pool: ResidentPool, model_path: ModelPath,
                 models: dict[str, str], turn_timeout_s: float, handshake_timeout_s: float,
                 hooks: TestHooks | None = None, driver_options: DriverOptions | None = None,
                 launch_gate: LaunchGate | None = None, turn_gate: TurnGate | None = None,
                 keepers: Keepers | None = None, launch_slots: LaunchSlots | None = None,
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
        self.turn_gate = turn_gate  # and until a turn on a resident has room to grow
        self.launch_slots = launch_slots  # CLIs starting at once, process start to handshake
        # (user_id, job_id) -> why a turn is being cancelled (its receipt's reason), e.g. chat_deleted
        self.cancel_reasons: dict[tuple[str, str], str] = {}
        self.drivers = drivers  # (runtime, launch inputs) -> driver: the registry

    def driver(self, runtime: str) -> Driver:
        """The runtime's driver with this host's launch inputs (pins, compaction policy)."""
        return self.drivers(runtime, self.driver_options)

    async def gateway(self, runtime: str, user_id: str, chat_id: str, member_id: str) -> GatewayConfig:
        """The member's own base URL through its sandbox's model socket, and a placeholder key."""
        return await self.model_path.gateway(user_id, chat_id, member_id, self.models[runtime])

    async def resolve_sandbox(self, user_id: str, chat_id: str, *, resident: bool = False,
                              seen: SeenSandbox | None = None) -> Sandbox:
        """The chat's sandbox with its model socket listening (opened before anything is
        started: the container's command connects to it as it starts). A lost sandbox's socket
        is closed again.
        ``resident``: a live resident serves the turn (its checks may come from fresh facts);
        ``seen``: the record as the job's claim read it (taken while still current)."""
        async def open_socket() -> None:
            await self.model_path.open(user_id, chat_id)
            mark("model_socket")

        try:
            # opened beside the check's engine reads, before anything is started (issue 16)
            return await self.manager.resolve(user_id, chat_id, resident=resident, before_replace=self.retire_container,
                                              seen=seen, before_start=open_socket)
        except (SandboxLost, ImageRefused, ModelGateNotReady):
            await self.model_path.close(user_id, chat_id)
            raise

    # -- receipts ---------------------------------------------------------------------------------

    async def _commit(self, ctx: TurnContext, receipt: Receipt, verified: Locator | None,
                      keeper: KeeperRecord | None = None) -> Receipt:
        return await commit_turn(self.store, self.model_path, ctx, receipt, verified, keeper)

    # -- the state machine ---------------------------------------------------------------------------

    async def execute(self, job: Job, emit: Emit, *,
                      claim_on_disk: Callable[[], Awaitable[None]] | None = None,
                      member: KnownMember | None = None, sandbox: SeenSandbox | None = None) -> Receipt:
        """``claim_on_disk``: returns once the job's claim is flushed; the CLI gets the message
        only after it (the claim was committed with ``sync=False``: runner.claim_on_disk).
        ``member``: the member's record, known current (else it is read here); ``sandbox``: the
        chat's sandbox record as the claim read it (taken under the chat's lock if still current)."""
        begun = anyio.Event()
        ctx = TurnContext(job=job, emit=emit, claim_on_disk=claim_on_disk, proxy_begun=begun.wait,
                          seen_sandbox=sandbox)
        key = (job.user_id, job.chat_id, job.member_id)

        async def begin() -> None:
            try:
                await self.model_path.begin(job)
            finally:
                begun.set()

        left = False
        try:
            # the proxy learns the member's requests belong to this job beside the member read
            # and the sandbox's checks; the CLI's input waits for it (``proxy_begun``)
            return await alongside(begin, lambda: self._read_and_execute(ctx, key, member))
        except BaseException:
            left = self.detaching
            raise
        finally:
            await self._end_of_turn(job, left=left)
            if ctx.sandbox is not None:
                self.manager.release(ctx.sandbox)  # a replacement by another member may go on

    async def _read_and_execute(self, ctx: TurnContext, key: tuple[str, str, str],
                                known: KnownMember | None) -> Receipt:
        ctx.member = known.record if known is not None else await self.store.get_member(*key)
        mark("member_read")
        return await self._execute(ctx, key)

    async def _begin(self, job: Job, key: tuple[str, str, str]) -> MemberRecord | None:
        """The proxy learns that the member's requests belong to ``job`` while the store reads the
        member; both are done before the turn can reach the CLI."""
        member = await alongside(lambda: self.model_path.begin(job), lambda: self.store.get_member(*key))
        mark("member_read")
        return member

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
        left = False
        try:
            ctx.member = await self._begin(job, key)  # the CLI's model requests still belong to this job
            resident = self.pool.get(key)
            try:
                ctx.sandbox = await self.resolve_sandbox(job.user_id, job.chat_id)
            except (SandboxLost, ImageRefused, ModelGateNotReady) as exc:
                await self.pool.retire(key, "sandbox lost before finishing")
                return await self._commit(ctx, build_receipt(ctx, Outcome.NOT_SETTLED, reason="daemon_restarted",
                                                             detail=str(exc)), None)
            if resident is None or resident.keeper is None:
                return await self._commit(ctx, build_receipt(ctx, Outcome.NOT_SETTLED, reason="daemon_restarted",
                                                             detail="the keeper was not re-adopted"), None)
            session, channel = resident.session, resident.keeper.channel
            ctx.cli_version = session.cli_version
            seen = channel.hello.written  # output the previous daemon may have read (and answered)
            return await self._run(ctx, key, session, resume=session.load_start(turn.start_json),
                                   answer=lambda: channel.offset > seen)
        except BaseException:
            left = self.detaching
            raise
        finally:
            await self._end_of_turn(job, left=left)
            if ctx.sandbox is not None:
                self.manager.release(ctx.sandbox)

    async def _end_of_turn(self, job: Job, *, left: bool = False) -> None:
        """The member's requests no longer belong to ``job`` — unless the turn was ``left`` to
        the next daemon (this one is shutting down under it): the proxy service, which outlives
        this daemon, keeps attributing the CLI's requests to the turn meanwhile."""
        if left:
            return
        with anyio.CancelScope(shield=True):
            await self.model_path.end(job)

    async def _execute(self, ctx: TurnContext, key: tuple[str, str, str]) -> Receipt:
        try:
            return await self._prepare_and_run(ctx, key)
        except RunAgain as again:  # once: the second preparation checks against the engine
            log.info("turn.runs_again", job_id=ctx.job.job_id, reason=str(again))
            return await self._prepare_and_run(ctx, key)

    async def _prepare_and_run(self, ctx: TurnContext, key: tuple[str, str, str]) -> Receipt:
        emit = ctx.emit
        try:
            session = await self._prepare(ctx, key)
        except Refusal as r:
            ctx.status = r.status
            receipt = build_receipt(ctx, Outcome.REFUSED, reason=r.reason, detail=r.detail or None)
            if r.sticky and ctx.member is not None:
                await self.store.mark_member_lost(*key, r.reason)
            return await self._commit(ctx, receipt, None)
        except NotStarted as ns:
            return await self._commit(ctx, build_receipt(ctx, Outcome.NOT_SETTLED, reason=ns.reason,
                                                         detail=ns.detail), None)
        emit({"type": "status", "context_status": ctx.status.value if ctx.status else None})
        mark("status_emitted")
        return await self._run(ctx, key, session)

    async def _prepare(self, ctx: TurnContext, key: tuple[str, str, str]) -> NativeSession:
        job, member = ctx.job, ctx.member
        if member is not None and member.runtime != job.runtime:
            raise Refusal("runtime_mismatch", status=None, sticky=False)
        saved = member.locator if member else None
        # Identity rule 2: a requested locator must equal the saved one; checked before launch.
        # The member is not condemned: the receipt says what its next turn would be (SPEC 3).
        if job.locator is not None and (saved is None or job.locator != saved.id):
            raise Refusal("locator_mismatch", status=await standing(self.store, self.pool, member, key), sticky=False)
        if member is not None and member.lost_reason is not None:
            raise Refusal("previously_lost")  # a LOST member stays LOST
        # Identity rule 3: settled turns but no resume locator (an unstarted lazy fork has none yet).
        if member is not None and member.settled_turns > 0 and saved is None and member.pending_fork is None:
            raise Refusal("member_locator_missing")
        t = time.monotonic()
        resident = self.pool.get(key)
        try:
            ctx.sandbox = await self.resolve_sandbox(job.user_id, job.chat_id,
                                                     resident=resident is not None and resident.alive,
                                                     seen=ctx.seen_sandbox)
        except ModelGateNotReady as exc:
            ctx.timings.sandbox = ctx.ms_since(t)
            raise NotStarted("model_gate_not_ready", str(exc)) from None
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
        note_replacement(ctx)
        if member is None:
            member = await self.store.ensure_member(*key, job.runtime)
            ctx.member = member
        t = time.monotonic()
        resident = self.pool.get(key)  # again: resolving may have retired it
        if resident is not None and serves(resident, saved, ctx.sandbox.container_id):
            if self.turn_gate is not None:
                await self.turn_gate(key, job.runtime)
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

    async def _launch(self, ctx: TurnContext, key: tuple[str, str, str], resume: Locator | None) -> NativeSession:
        job = ctx.job
        driver = self.driver(job.runtime)
        assert ctx.member is not None
        dirs = self.manager.member_dirs(ctx.member.home_member_id)
        gateway = await self.gateway(job.runtime, job.user_id, job.chat_id, job.member_id)
        pending = ctx.member.pending_fork
        if resume is None and pending is not None:
            # A fork the CLI makes itself as this first turn starts (Claude --fork-session).
            parent = to_locator(pending.parent)
            assert parent is not None
            launch: Launch = driver.plan_fork(member_paths(dirs), gateway, parent, pending.at_turn)
        else:
            launch = driver.plan(member_paths(dirs), gateway, resume)
        async with self.launch_slots.hold(job.runtime) if self.launch_slots else nullcontext():
            mark("launch_slot")
            return await self._start(ctx, key, driver, launch, dirs)

    async def _start(self, ctx: TurnContext, key: tuple[str, str, str], driver: Driver, launch: Launch,
                     dirs: MemberDirs) -> NativeSession:
        """Start the CLI (under the memory budget's gate) and take its handshake."""
        job, sandbox = ctx.job, ctx.sandbox
        assert sandbox is not None
        keepers = self.keepers
        host_init_pid = sandbox.init_pid
        async with self.launch_gate(key, job.runtime) if self.launch_gate else nullcontext():
            if keepers is not None:
                try:
                    handle = await keepers.start(sandbox, dirs, launch, job.member_id)
                    mark("attached")
                except KeeperError as exc:
                    raise NotStarted("keeper_unavailable", str(exc)) from None
                transport: Transport = exec_transport(handle.channel)
                if self.hooks.wrap_transport is not None:
                    transport = self.hooks.wrap_transport(transport, job.runtime)
                session = driver.session(transport, launch)
                resident = Resident(key=key, runtime=job.runtime, session=session, container_id=sandbox.container_id,
                                    pidfile=handle.paths.pidfile,  # the keeper's group: it and the CLI's tree below it
                                    relay_socket=handle.paths.socket,
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
            if hf.reason == HandshakeReason.MODEL_NOT_LISTENING:  # as when the daemon waited for the gate itself
                raise NotStarted("model_gate_not_ready", hf.detail) from None
            raise NotStarted(f"handshake_{hf.reason.value}", hf.detail) from None
        except TimeoutError:
            await self.pool.retire(key, "handshake timeout")
            raise NotStarted("handshake_timeout", f"no handshake within {self.handshake_timeout_s}s") from None
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

        async def input_ready() -> None:
            if ctx.claim_on_disk is not None:
                await ctx.claim_on_disk()  # a power loss never leaves a message the CLI saw unclaimed
            if ctx.proxy_begun is not None:
                await ctx.proxy_begun()  # the CLI's requests are this job's from its first one

        resident = self.pool.get(key)
        keepers = self.keepers
        if resident is not None and resident.keeper is not None and keepers is not None:
            handle, t_ctx = resident.keeper, ctx

            async def record_start(start: TurnStart) -> None:
                # The turn's record (SPEC 14) needs the turn's start, which the driver makes inside
                # run_turn; the CLI's input waits for it and for the claim's flush and the proxy's
                # begin. A failed wait is raised past the turn as itself (InputNotReady).
                await keepers.begin_turn(key, job.runtime, handle, session, job, start, status=t_ctx.status,
                                         started_at=t_ctx.started_at, timings=t_ctx.timings, input_ready=input_ready)
                mark("turn_recorded")

            session.before_turn = record_start
        else:
            await input_ready()
        mark("before_input")
        t = time.monotonic()
        ctx.input_ns = time.time_ns()
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
        except InputNotReady as not_ready:
            raise not_ready.cause  # the CLI got nothing: as if it failed before the turn
        except BaseException:
            if self.detaching and resident is not None and resident.keeper is not None:
                raise  # the keeper keeps the turn's output; the next daemon finishes it
            with anyio.CancelScope(shield=True):
                await self.pool.retire(key, "turn cancelled")
                why = self.cancel_reasons.get((job.user_id, job.job_id), "cancelled")
                receipt = build_receipt(ctx, Outcome.NOT_SETTLED, reason=why)
                await self._commit(ctx, receipt, None)
            raise
        if self.detaching and resident is not None and resident.keeper is not None:
            raise Detached(job.job_id)  # our attach ended under the turn: not its outcome
        ctx.timings.turn = ctx.ms_since(t)
        mark("settled")
        if self.pool.get(key) is not None:
            self.pool.get(key).last_used = time.monotonic()
        ctx.compacted = bool(getattr(outcome, "compacted", False))
        if (isinstance(outcome, NotSettled) and outcome.reason == NotSettledReason.TRANSPORT_CLOSED and first
                and ctx.sandbox is not None and ctx.sandbox.from_events):
            lost = await recheck(ctx, key, resident_made_ns=resident.made_ns if resident is not None else None,
                                 resolve=self.resolve_sandbox, manager=self.manager, pool=self.pool)
            if lost is not None:
                ctx.status = lost.status
                await self.store.mark_member_lost(*key, lost.reason)
                return await self._commit(ctx, build_receipt(ctx, Outcome.REFUSED, reason=lost.reason,
                                                             detail=lost.detail or None), None)
        if isinstance(outcome, NotSettled):
            await self.pool.retire(key, f"not settled: {outcome.reason.value}")
            receipt = build_receipt(ctx, Outcome.NOT_SETTLED, reason=outcome.reason.value, text=outcome.assistant_text,
                                    detail=outcome.detail)
            return await self._commit(ctx, receipt, None)
        observed = outcome.observed_locator
        if expected is None and ctx.status == ContextStatus.NEW:
            expected = observed  # the CLI minted it; nothing earlier to compare against
        if observed is None or expected is None or observed != expected:
            # Identity rule 1: a continuation reporting another id fails; nothing is saved.
            await self.pool.retire(key, "identity mismatch")
            detail = f"expected {expected}, CLI reported {observed}"
            receipt = build_receipt(ctx, Outcome.FAILED, reason=FailureReason.IDENTITY_MISMATCH.value,
                                    settlement=outcome.model_copy(update={"detail": detail}),
                                    text=outcome.assistant_text)
            return await self._commit(ctx, receipt, None)
        session.locator = observed
        result = Outcome.FAILED if outcome.is_error else Outcome.SUCCEEDED
        reason = (outcome.reason.value if outcome.reason else "api_error") if outcome.is_error else None
        receipt = build_receipt(ctx, result, reason=reason, settlement=outcome, text=outcome.assistant_text,
                                locator_after=observed.id)
        current = self.pool.get(key)
        kept, after = (current.keeper if current is not None else None), None
        if kept is not None and keepers is not None:
            # the keeper's between-turns record commits with the receipt (one write, not two)
            after = keepers.after_turn(key, job.runtime, kept, session)
        receipt = await self._commit(ctx, receipt, observed, after)
        if kept is not None and after is not None:
            try:
                await Keepers.acknowledge(kept, after)
            except Exception as exc:  # noqa: BLE001 - committed already; a keeper we cannot tell retires
                log.warning("keeper.ack_failed", job_id=job.job_id, error=repr(exc))
                await self.pool.retire(key, "keeper acknowledgement failed")
        if outcome.retire_after and not self.hooks.disable_retire_after:
            # SPEC section 6: after a Claude api_retry, save the verified locator, then retire.
            await self.pool.retire(key, "retire_after (api_retry seen)")
        return receipt
