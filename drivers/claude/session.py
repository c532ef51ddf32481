"""Claude Code driver: ``claude -p`` in stream-json mode, one resident process per member.

Launch plans: :mod:`drivers.claude.launch`. Handshake: the control protocol's ``initialize``
request. 2.1.220 answers it only after it has loaded the resumed transcript; an unknown id
prints an error ``result`` ("No conversation found…") and exits instead. Turns: the shared
template (drivers/session.py) with :class:`drivers.claude.wire.ClaudeTurn` as tracker, plus a
short transcript-flush window after settlement (:attr:`ClaudeSettings.persist_grace_s`).
Messages are sent unchanged; a leading ``/`` needs the trailing-empty-block form of
:func:`drivers.claude.wire.user_line` or the CLI would run it as a slash command.
Forks are lazy: the CLI forks when the fork's first turn starts (``--fork-session``).
"""

from __future__ import annotations

import glob
from typing import Any

import anyio

from drivers.base import Driver, Launch, LaunchError
from drivers.claude import launch as plans
from drivers.claude.launch import ClaudeSettings
from drivers.claude.wire import (
    ClaudeTurn,
    ClaudeTurnStart,
    TurnTracker,
    control_request,
    control_response_for,
    result_errors,
    root_session_id,
)
from drivers.models import (
    DriverOptions,
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
from drivers.session import NativeSession, Tracker, TurnStart
from drivers.transport import Transport, TransportError


class ClaudeDriver(Driver):
    runtime = "claude"
    fork_mode = "lazy"  # Claude writes nothing until a message arrives: the fork's first turn forks

    def __init__(self, settings: ClaudeSettings | None = None, *, options: DriverOptions | None = None) -> None:
        self.settings = settings or ClaudeSettings()
        self.options = options or DriverOptions()

    def transcript(self, paths: MemberPaths, locator: Locator) -> str:
        """Where the CLI keeps ``locator``'s transcript (keyed by the ORIGINAL cwd)."""
        return plans.transcript(paths, locator)

    def native_state(self, paths: MemberPaths, locator: Locator) -> list[str]:
        return [glob.escape(self.transcript(paths, locator))]

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        return plans.plan(self.settings, paths, gateway, resume, compaction=self.options.native_compaction)

    def plan_fork(self, paths: MemberPaths, gateway: GatewayConfig, parent: Locator, at_turn: int | None,
                  *, at_message: str | None = None) -> Launch:
        """See :func:`drivers.claude.launch.plan_fork`."""
        return plans.plan_fork(self.settings, paths, gateway, parent, at_turn, at_message=at_message,
                               compaction=self.options.native_compaction)

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
        self.last_tracker: TurnTracker | None = None  # the evidence of the latest turn
        self.quiesced = True  # False after a turn whose native turn was not seen to end
        self._pending: list[dict[str, Any]] = []  # lines read ahead during the flush window

    @property
    def handshake_timeout_s(self) -> float:
        return self.settings.handshake_timeout_s

    @property
    def handshake_answer(self) -> str:
        return "initialize"

    @property
    def interrupt_grace_s(self) -> float:
        return self.settings.interrupt_grace_s

    # ---------------------------------------------------------------- handshake

    def launch_failed(self, exc: LaunchError) -> HandshakeFailed:
        if exc.payload.get("reason") == "fork_point_missing":  # drivers/claude/fork_at.py
            return HandshakeFailed(HandshakeReason.NATIVE_STATE_MISSING, str(exc))
        return super().launch_failed(exc)

    async def open(self) -> None:
        req = control_request("initialize")
        try:
            await self.send_object(req)
        except TransportError:
            pass  # a launcher precheck may already have printed launch_error and exited
        await self._await_initialize(req["request_id"])

    async def _await_initialize(self, request_id: str) -> None:
        expected = self.expected.id if self.expected else None
        missing = HandshakeReason.NATIVE_STATE_MISSING if self.launch.resume else HandshakeReason.PROCESS_FAILED
        while True:
            obj = await self.read_object()
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

    # ---------------------------------------------------------------- turns (the template: drivers/session.py)

    start_model = ClaudeTurnStart

    def state(self) -> dict[str, Any]:
        return {"pid": self.pid, "last_assistant_uuid": self.last_assistant_uuid, "quiesced": self.quiesced}

    def restore_state(self, snap: dict[str, Any]) -> None:
        self.pid = snap.get("pid")
        self.last_assistant_uuid = snap.get("last_assistant_uuid")
        self.quiesced = bool(snap.get("quiesced", True))

    def turn_start(self) -> ClaudeTurnStart:
        return ClaudeTurnStart(turn=self.next_turn(), expected=self.expected.id if self.expected else None,
                               state_events=self.settings.state_events)

    def tracker(self, start: TurnStart) -> ClaudeTurn:
        assert isinstance(start, ClaudeTurnStart)
        return ClaudeTurn(start)

    async def settled(self, tracker: Tracker, settlement: Settlement) -> TurnOutcome:
        assert isinstance(tracker, ClaudeTurn)
        # outside the turn's timeout: the flush window is bounded by itself
        if not await self._outlive_flush_window():
            return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED,
                              detail="the process ended before its transcript flush window passed",
                              assistant_text=tracker.evidence.assistant_text())
        evidence = tracker.evidence
        if evidence.cli_version and not self.cli_version:
            self.cli_version = evidence.cli_version
        self._log.info("claude.settled", is_error=settlement.is_error, reason=settlement.reason,
                       retire_after=settlement.retire_after, early_idles=evidence.early_idles,
                       ignored_results=evidence.ignored_results)
        return settlement

    def turn_ended(self, tracker: Tracker, outcome: TurnOutcome) -> None:
        assert isinstance(tracker, ClaudeTurn)
        evidence = tracker.evidence
        self.last_tracker = evidence
        if tracker.last_assistant_uuid is not None:
            self.last_assistant_uuid = tracker.last_assistant_uuid
        if evidence.init_mismatch:
            self._log.warning("claude.identity_mismatch", expected=evidence.expected, observed=evidence.mismatch_id)
        # the native turn verifiably ended and the process outlived it (a settled turn, or an
        # interrupted one drained to its result + idle): it may take the next message
        self.quiesced = evidence.settled and not (isinstance(outcome, NotSettled)
                                                  and outcome.reason == NotSettledReason.TRANSPORT_CLOSED)

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
                except (LaunchError, TransportError):
                    return False
                if obj is None:
                    return False
                # An idle CLI prints nothing; anything that does come belongs to what follows.
                self._pending.append(obj)
        return True
