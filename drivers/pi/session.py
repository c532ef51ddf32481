"""Pi driver: ``pi --mode rpc`` over stdio JSONL (pinned @mariozechner/pi-coding-agent 0.73.1).

Configuration and launch decisions: :mod:`drivers.pi.launch`. Wire parsing and the
settlement rule (``agent_end`` + a ``get_state`` barrier): :mod:`drivers.pi.wire`.

Identity: sessions are addressed by **path**. NEW picks ``<agentDir>/sessions/<uuid>.jsonl``
and pi creates the session at exactly that path; its id comes from ``get_state``. The file
is written lazily, when the first assistant message ends (any stopReason), so a NEW
locator becomes verifiable on disk only after the first settled turn that produced an
assistant ``message_end`` (:attr:`PiSession.persisted`). RESTORED passes the saved path
with launcher prechecks (file exists, header ``id`` = saved id): without them a missing
file would silently become a *new* session at the same path.

stdin stays open for the whole life of the process: pi exits on stdin EOF even mid-turn,
persisting nothing (protocols/pi.md §7), so an unexpected end of stdout is always
``transport_closed``, whatever the exit code.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import anyio

from drivers.base import Driver, EventSink, Launch, LaunchError, NativeSession, as_dict, as_list, discard
from drivers.models import (
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    NotSettled,
    NotSettledReason,
    TurnOutcome,
)
from drivers.pi import launch as plans
from drivers.pi.launch import PiSettings, planned_path, sessions_dir
from drivers.pi.wire import PiTurn, state_locator
from drivers.transport import Transport, TransportClosed

__all__ = ["ForkFailed", "PiDriver", "PiSession", "PiSettings"]


class ForkFailed(Exception):
    """``get_fork_messages`` / ``fork`` / ``clone`` was refused or did not yield a new session."""


class PiSession(NativeSession):
    runtime = "pi"

    def __init__(self, transport: Transport, launch: Launch, settings: PiSettings | None = None) -> None:
        super().__init__(transport, launch)
        self.settings = settings or PiSettings()
        self.reported: Locator | None = None  # what get_state said at the handshake (NEW: not on disk yet)
        self.persisted = launch.resume  # the session file exists (RESTORED, or after an assistant message_end)
        self.turn: PiTurn | None = None  # the turn in flight
        self._ids = itertools.count(1)
        self._send_lock = anyio.Lock()
        self._busy = anyio.Lock()

    # ------------------------------------------------------------ plumbing

    def _next_id(self, prefix: str) -> str:
        return f"{prefix}{next(self._ids)}"

    async def _send(self, obj: dict[str, Any]) -> None:
        async with self._send_lock:  # interrupt() may send while run_turn sends a barrier
            try:
                await self.send_object(obj)
            except UnicodeEncodeError:
                # A lone surrogate cannot be UTF-8 encoded raw; as a \uXXXX escape pi's
                # JSON.parse restores the very same string.
                await self.transport.send(json.dumps(obj, ensure_ascii=True).encode())

    async def _command(self, ctype: str, **fields: Any) -> dict[str, Any] | None:
        """Send one command and wait for its response; None if the stream ended first.

        Only for idle moments (handshake, fork): events read meanwhile are dropped.
        """
        cid = self._next_id(ctype[:2])
        await self._send({"id": cid, "type": ctype, **fields})
        while True:
            obj = await self.read_object()
            if obj is None:
                return None
            if obj.get("type") == "response" and obj.get("id") == cid:
                return obj

    def _died(self, what: str) -> str:
        tail = self.transport.diagnostics().strip().splitlines()[-5:]
        return f"stream ended during {what}" + (f": {' | '.join(tail)}" if tail else "")

    # ------------------------------------------------------------ handshake

    async def handshake(self) -> None:
        try:
            with anyio.fail_after(self.settings.handshake_timeout_s):
                resp = await self._command("get_state")
        except LaunchError as exc:
            raise self.launch_failed(exc) from exc
        except TransportClosed as exc:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"{exc}; {self._died('get_state')}") from exc
        except TimeoutError as exc:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED,
                                  f"no get_state answer within {self.settings.handshake_timeout_s}s") from exc
        if resp is None:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, self._died("get_state"))
        if resp.get("success") is not True:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"get_state refused: {resp.get('error')!r}")
        data = as_dict(resp.get("data"))
        observed = state_locator(data)
        count = data.get("messageCount")
        self.reported = observed
        if self.launch.resume:
            exp = self.expected
            if observed is None or exp is None or observed != exp:
                raise HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH,
                                      f"pi resumed {observed} instead of {exp}", observed=observed)
            if not isinstance(count, int) or count <= 0:
                # The path was opened but holds no conversation: pi started a new, empty
                # session there — the saved one is not what this process serves.
                raise HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH,
                                      f"resumed session {observed} has messageCount={count!r}", observed=observed)
            self.locator = observed
            self.persisted = True
        else:
            want = planned_path(self.launch.spec)
            if observed is None or (want is not None and observed.path != want) or count not in (0, None):
                raise HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH,
                                      f"NEW session reported {observed} (messageCount={count!r}); planned path {want}",
                                      observed=observed)
        self._log.info("pi.handshake", locator=str(observed), resume=self.launch.resume)

    # ------------------------------------------------------------ turns

    async def run_turn(self, message: str, *, emit: EventSink = discard, timeout_s: float = 600.0) -> TurnOutcome:
        async with self._busy:
            turn = PiTurn(prompt_id=self._next_id("p"))
            self.turn = turn
            try:
                with anyio.move_on_after(timeout_s):
                    return await self._turn(message, turn, emit)
                await self._abort(turn)
                return NotSettled(reason=NotSettledReason.TIMEOUT, detail=f"no settlement within {timeout_s}s",
                                  assistant_text=turn.streamed_text)
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await self._abort(turn)
                raise
            except (TransportClosed, LaunchError) as exc:
                return await self.not_settled_on_error(exc, turn.streamed_text)
            finally:
                self.turn = None

    async def _turn(self, message: str, turn: PiTurn, emit: EventSink) -> TurnOutcome:
        # The message goes out byte for byte: json.dumps(ensure_ascii=False) escapes only what
        # JSON requires, and LF framing is safe because "\n" inside the text is escaped.
        await self._send({"id": turn.prompt_id, "type": "prompt", "message": message})
        while True:
            obj = await self.read_object()
            if obj is None:
                return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=self._died("the turn"),
                                  assistant_text=turn.streamed_text)
            step = turn.feed(obj)
            for event in step.events:
                emit(event)
            if turn.assistant_ended:
                self.persisted = True  # pi flushes the session file on the first assistant message_end
            if step.rejected is not None:
                return NotSettled(reason=NotSettledReason.COMMAND_REJECTED, detail=step.rejected)
            if step.no_evidence is not None:
                return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail=step.no_evidence,
                                  assistant_text=turn.streamed_text)
            if step.settlement is not None:
                self.turns += 1
                self._verified(step.settlement.observed_locator)
                return step.settlement
            if step.send_barrier:
                bid = self._next_id("b")
                turn.barrier_sent(bid)
                await self._send({"id": bid, "type": "get_state"})

    def _verified(self, observed: Locator | None) -> None:
        """Adopt the CLI-reported locator only when it is the one this process must serve;
        a different one is left for the runner to reject (never silently corrected)."""
        want = self.expected if self.expected is not None else self.reported
        if observed is not None and observed == want:
            self.locator = observed

    async def _abort(self, turn: PiTurn) -> None:
        """Best effort ``abort`` for a timed-out or cancelled turn (the process is retired anyway)."""
        turn.aborted = True
        with anyio.move_on_after(self.settings.abort_grace_s):
            try:
                await self._send({"id": self._next_id("a"), "type": "abort"})
            except (TransportClosed, OSError) as exc:
                self._log.info("pi.abort_failed", error=str(exc))

    async def interrupt(self) -> bool:
        """Send pi's native ``abort``; the running :meth:`run_turn` then settles the turn
        (``stopReason:"aborted"``, or the cancelled retry). False when no turn is running."""
        turn = self.turn
        if turn is None:
            return False
        turn.aborted = True
        await self._send({"id": self._next_id("a"), "type": "abort"})
        return True

    # ------------------------------------------------------------ fork

    async def fork(self, at_turn: int | None = None) -> Locator:
        """Fork this session with pi's own mechanism and switch this process to the fork.

        ``at_turn=k`` keeps the first ``k`` user turns (``fork`` at the (k+1)-th user
        message: the new file holds the history *before* it); ``None`` (or ``k`` >= the
        number of turns) keeps everything (``clone``). The new file goes to this process's
        ``--session-dir`` (see :meth:`PiDriver.plan_fork`). Returns the fork's locator;
        afterwards this session serves the fork (``expected``/``locator`` are updated).
        """
        async with self._busy:
            if not self.persisted or self.locator is None:
                raise ForkFailed("nothing to fork: no settled, persisted turn in this session")
            if at_turn is not None and at_turn < 1:
                raise ForkFailed("a fork keeps at least one turn; start a NEW member instead")
            try:
                listed = await self._command("get_fork_messages")
                if listed is None or listed.get("success") is not True:
                    raise ForkFailed(f"get_fork_messages: {self._died('fork') if listed is None else listed}")
                entries = [m for m in as_list(as_dict(listed.get("data")).get("messages"))
                           if isinstance(m, dict) and isinstance(m.get("entryId"), str)]
                if at_turn is None or at_turn >= len(entries):
                    resp = await self._command("clone")
                else:
                    resp = await self._command("fork", entryId=entries[at_turn]["entryId"])
                if resp is None or resp.get("success") is not True or as_dict(resp.get("data")).get("cancelled"):
                    raise ForkFailed(f"fork/clone refused: {self._died('fork') if resp is None else resp}")
                state = await self._command("get_state")
            except (TransportClosed, LaunchError) as exc:
                raise ForkFailed(f"transport closed: {exc}") from exc
            data = as_dict(as_dict(state).get("data"))
            new = state_locator(data)
            if new is None or new.id == self.locator.id or new.path == self.locator.path:
                raise ForkFailed(f"after the fork pi reports {new} (source {self.locator})")
            self._log.info("pi.fork", source=str(self.locator), fork=str(new), at_turn=at_turn,
                           messages=data.get("messageCount"))
            self.expected = self.locator = self.reported = new
            return new


class PiDriver(Driver):
    runtime = "pi"

    def __init__(self, settings: PiSettings | None = None, **overrides: Any) -> None:
        base = settings or PiSettings()
        self.settings = base.model_copy(update=overrides) if overrides else base

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        return plans.plan(self.settings, paths, gateway, resume)

    def plan_fork(self, paths: MemberPaths, gateway: GatewayConfig, source: Locator) -> Launch:
        """The process that forks ``source`` for a NEW member whose paths are ``paths``.

        It resumes the source file (RESTORED prechecks and handshake on ``source``) with
        ``--session-dir`` set to the new member's sessions dir, so :meth:`PiSession.fork`
        writes the fork there; the process then serves the fork. Never run it while the
        source member has a resident process: pi has no locking on session files.
        """
        return self.plan(paths, gateway, resume=source)

    def session(self, transport: Transport, launch: Launch) -> PiSession:
        return PiSession(transport, launch, self.settings)

    @staticmethod
    def sessions_dir(paths: MemberPaths) -> str:
        return sessions_dir(paths)
