"""Claude Code driver: ``claude -p`` in stream-json mode, one resident process per member.

Launch plans: :mod:`drivers.claude.launch`. Handshake: the control protocol's ``initialize``
request. 2.1.220 answers it only after it has loaded the resumed transcript; an unknown id
prints an error ``result`` ("No conversation found…") and exits instead. Settlement: see
:class:`drivers.claude.wire.TurnTracker`, plus a short transcript-flush window
(:attr:`ClaudeSettings.persist_grace_s`). Messages are sent unchanged; a leading ``/`` needs the
trailing-empty-block form of :func:`drivers.claude.wire.user_line` or the CLI would run it as a
slash command.
"""

from __future__ import annotations

from typing import Any

import anyio

from drivers.base import (
    Driver,
    EventSink,
    Launch,
    LaunchError,
    NativeSession,
    discard,
)
from drivers.claude import launch as plans
from drivers.claude.launch import ClaudeSettings
from drivers.claude.wire import (
    TurnTracker,
    control_error_reply,
    control_request,
    control_response_for,
    result_errors,
    root_session_id,
    user_line,
)
from drivers.models import (
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    NotSettled,
    NotSettledReason,
    Settlement,
    TurnOutcome,
)
from drivers.transport import Transport, TransportClosed


class ClaudeDriver(Driver):
    runtime = "claude"

    def __init__(self, settings: ClaudeSettings | None = None) -> None:
        self.settings = settings or ClaudeSettings()

    def transcript(self, paths: MemberPaths, locator: Locator) -> str:
        """Where the CLI keeps ``locator``'s transcript (keyed by the ORIGINAL cwd)."""
        return plans.transcript(paths, locator)

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        return plans.plan(self.settings, paths, gateway, resume)

    def plan_fork(self, paths: MemberPaths, gateway: GatewayConfig, parent: Locator, at_turn: int | None,
                  *, at_message: str | None = None) -> Launch:
        """See :func:`drivers.claude.launch.plan_fork`."""
        return plans.plan_fork(self.settings, paths, gateway, parent, at_turn, at_message=at_message)

    def session(self, transport: Transport, launch: Launch) -> "ClaudeSession":
        return ClaudeSession(transport, launch, self.settings)


class ClaudeSession(NativeSession):
    runtime = "claude"

    def __init__(self, transport: Transport, launch: Launch, settings: ClaudeSettings | None = None) -> None:
        super().__init__(transport, launch)
        self.settings = settings or ClaudeSettings()
        self.pid: int | None = None
        # uuid of the last root assistant message seen (= its transcript entry uuid): a
        # ready-made ``plan_fork(at_message=...)`` anchor for the turn that produced it
        self.last_assistant_uuid: str | None = None
        self.last_tracker: TurnTracker | None = None
        self.quiesced = True  # False after a turn that ended unsettled and was not drained
        self._pending: list[dict[str, Any]] = []  # lines read ahead during the flush window

    # ---------------------------------------------------------------- handshake

    def launch_failed(self, exc: LaunchError) -> HandshakeFailed:
        if exc.payload.get("reason") == "fork_point_missing":  # drivers/claude/fork_at.py
            return HandshakeFailed(HandshakeReason.NATIVE_STATE_MISSING, str(exc))
        return super().launch_failed(exc)

    async def handshake(self) -> None:
        req = control_request("initialize")
        try:
            await self.send_object(req)
        except TransportClosed:
            pass  # a launcher precheck may already have printed launch_error and exited
        try:
            with anyio.fail_after(self.settings.handshake_timeout_s):
                await self._await_initialize(req["request_id"])
        except TimeoutError:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED,
                                  f"no initialize response in {self.settings.handshake_timeout_s:g}s") from None

    async def _await_initialize(self, request_id: str) -> None:
        expected = self.expected.id if self.expected else None
        missing = HandshakeReason.NATIVE_STATE_MISSING if self.launch.resume else HandshakeReason.PROCESS_FAILED
        while True:
            try:
                obj = await self.read_object()
            except LaunchError as exc:
                raise self.launch_failed(exc) from None
            if obj is None:
                # A bare EOF is no evidence about the native state (the process or container
                # may have been killed); only the precheck or the CLI's own error says "missing".
                raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"stream ended before the initialize "
                                      f"response: {self.transport.diagnostics()[-500:]}")
            resp = control_response_for(obj, request_id)
            if resp is not None:
                if resp.get("subtype") != "success":
                    raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"initialize refused: {resp.get('error')}")
                body = resp.get("response")
                if isinstance(body, dict):
                    # 2.1.332 lists claude_code_version here; 2.1.220 does not (init carries it)
                    if isinstance(body.get("claude_code_version"), str):
                        self.cli_version = body["claude_code_version"]
                    if isinstance(body.get("pid"), int):
                        self.pid = body["pid"]
                self._log.info("claude.handshake_ok", resume=self.launch.resume, expected=expected, pid=self.pid)
                return
            if obj.get("type") == "result":
                # "No conversation found with session ID: …" (error_during_execution), or a
                # bad --resume-session-at point: the resume did not happen.
                raise HandshakeFailed(missing, result_errors(obj) or str(obj.get("result") or "error result"))
            sid = root_session_id(obj)
            if expected is not None and sid is not None and sid != expected:
                raise HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH, f"CLI reported session {sid}",
                                      observed=Locator(id=sid))

    # ---------------------------------------------------------------- turns

    async def run_turn(self, message: str, *, emit: EventSink = discard, timeout_s: float = 600.0) -> TurnOutcome:
        tracker = TurnTracker(self.expected.id if self.expected else None, state_events=self.settings.state_events)
        self.last_tracker = tracker
        self.quiesced = False
        try:
            outcome: TurnOutcome | None = None
            with anyio.move_on_after(timeout_s):
                outcome = await self._drive(message, tracker, emit)
            if outcome is None:
                await self._interrupt_and_drain(tracker, emit)
                return NotSettled(reason=NotSettledReason.TIMEOUT, detail=f"no settlement within {timeout_s:g}s",
                                  assistant_text=tracker.partial_text())
            if isinstance(outcome, Settlement):
                return await self._finish(outcome, tracker)
            return outcome
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                await self._send_interrupt()
            raise

    async def _drive(self, message: str, tracker: TurnTracker, emit: EventSink) -> TurnOutcome:
        try:
            await self.send_object(user_line(message))
        except TransportClosed as exc:
            return await self.not_settled_on_error(exc)
        interrupted = False
        while True:
            try:
                obj = await self.read_object()
            except LaunchError as exc:
                return await self.not_settled_on_error(exc, tracker.partial_text())
            if obj is None:
                detail = "stream ended before settlement"
                if tracker.result is not None:
                    detail = "stream ended after the result but before idle"
                return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=detail,
                                  assistant_text=tracker.partial_text())
            kind = obj.get("type")
            if kind == "control_request":
                await self._refuse_control(obj)
                continue
            if kind == "control_response":
                continue  # the answer to our interrupt
            for event in tracker.feed(obj):
                self._emit(emit, event)
            self._note_anchor(obj)
            if tracker.init_mismatch and not interrupted:
                # Another session answers: stop spending tokens; the settlement still
                # reports the id the CLI showed and the runner fails the turn.
                self._log.warning("claude.identity_mismatch", expected=tracker.expected, observed=tracker.mismatch_id)
                interrupted = True
                await self._send_interrupt()
            if tracker.settled:
                return tracker.settlement()

    async def _finish(self, settlement: Settlement, tracker: TurnTracker) -> TurnOutcome:
        # outside the turn's timeout: the flush window is bounded by itself
        if not await self._outlive_flush_window():
            return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED,
                              detail="the process ended before its transcript flush window passed",
                              assistant_text=tracker.assistant_text())
        self.turns += 1
        self.quiesced = True
        if tracker.cli_version and not self.cli_version:
            self.cli_version = tracker.cli_version
        if self.expected is not None and settlement.observed_locator == self.expected:
            self.locator = self.expected
        self._log.info("claude.settled", is_error=settlement.is_error, reason=settlement.reason,
                       retire_after=settlement.retire_after, early_idles=tracker.early_idles,
                       ignored_results=tracker.ignored_results)
        return settlement

    async def read_object(self) -> dict[str, Any] | None:
        if self._pending:
            return self._pending.pop(0)
        return await super().read_object()

    async def _outlive_flush_window(self) -> bool:
        """Watch the stream for ``persist_grace_s`` after settlement (ClaudeSettings)."""
        if self.settings.persist_grace_s <= 0:
            return True
        with anyio.move_on_after(self.settings.persist_grace_s):
            while True:
                try:
                    obj = await super().read_object()
                except LaunchError:
                    return False
                if obj is None:
                    return False
                # An idle CLI prints nothing; anything that does come belongs to what follows.
                self._pending.append(obj)
        return True

    def _note_anchor(self, obj: dict[str, Any]) -> None:
        if obj.get("type") == "assistant" and obj.get("parent_tool_use_id") is None and isinstance(obj.get("uuid"), str):
            self.last_assistant_uuid = obj["uuid"]

    def _emit(self, emit: EventSink, event: Any) -> None:
        try:
            emit(event)
        except Exception:  # a consumer's bug must not break the protocol loop
            self._log.exception("claude.emit_failed")

    async def _refuse_control(self, obj: dict[str, Any]) -> None:
        # Only sent with --permission-prompt-tool stdio, which this driver never passes; an
        # unanswered request would block the turn forever, so refuse it.
        request_id = obj.get("request_id")
        if isinstance(request_id, str):
            try:
                await self.send_object(control_error_reply(request_id, "not supported by this supervisor"))
            except TransportClosed:
                pass

    async def _send_interrupt(self) -> bool:
        try:
            await self.send_object(control_request("interrupt"))
            return True
        except TransportClosed:
            return False

    async def _interrupt_and_drain(self, tracker: TurnTracker, emit: EventSink) -> None:
        """After a timeout: interrupt, and let the aborted turn finish so the transcript is
        consistent (observed: result ``aborted_streaming`` + idle within ~20 ms, and the
        process takes the next message). The turn stays unsettled either way."""
        if not await self._send_interrupt():
            return
        with anyio.move_on_after(self.settings.interrupt_grace_s):
            while not tracker.settled:
                try:
                    obj = await self.read_object()
                except LaunchError:
                    return
                if obj is None:
                    return
                if obj.get("type") == "control_request":
                    await self._refuse_control(obj)
                elif obj.get("type") != "control_response":
                    for event in tracker.feed(obj):
                        self._emit(emit, event)
            self.quiesced = True
