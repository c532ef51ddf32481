"""The turn template every CLI session shares: :class:`NativeSession`.

A CLI supplies what differs — its native handshake (:meth:`NativeSession.open`) and a
:class:`Tracker` per turn; the template owns what must not differ between five CLIs:

* **one timeout style**: a cancel scope around the turn (``move_on_after``), never a sleep;
* **timeout** sends the CLI's native interrupt and reads until the interrupted turn has ended
  (the native history stays consistent); **cancellation** sends it shielded, drains only where
  the CLI needs it (``Tracker.drain_on_cancel``), then re-raises; both bounded by
  ``interrupt_grace_s``;
* **guarded emit**: an event callback that raises is logged, never breaks the protocol loop;
* **error mapping, once**: a transport error (:class:`~drivers.transport.TransportError`) or a
  launcher ``launch_error`` mid-turn is ``NotSettled(transport_closed)``; in the handshake it is
  ``HandshakeFailed(process_failed)`` (a precheck's own reason when the launcher names one),
  a handshake timeout likewise;
* **locator adoption**: after a settlement whose ``observed_locator`` equals the locator this
  process serves (``expected``), ``locator`` is set; a different one is left for the runner to
  reject, never "corrected".

**Re-feedable trackers.** A tracker's state comes only from its :class:`TurnStart` and the lines
fed to it; everything it sends (the user message, barriers, refusals, the interrupt) it returns
in :class:`Step` ``send`` with ids derived from the start. So a turn's outcome can be recomputed
from its raw output lines: :meth:`NativeSession.replay_turn` feeds the lines read from the offset
where the turn began (a later issue re-reads them from an in-sandbox keeper after a daemon
restart) to a tracker built from the turn's start and reaches the same outcome. ``TurnStart``
is a pydantic model, so it can be stored next to that offset.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog
from pydantic import BaseModel, ConfigDict

from drivers.base import EventSink, ForkFailed, Launch, LaunchError, discard, parse_json_line
from drivers.models import (
    DriverEvent,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    NotSettled,
    NotSettledReason,
    Settlement,
    TurnOutcome,
)
from drivers.transport import Transport, TransportError

log = structlog.get_logger("driver")


class TurnStart(BaseModel):
    """The state a turn's tracker starts from (ids it will use, what it must verify)."""

    model_config = ConfigDict(frozen=True)

    turn: int  # this process's turn sequence number, from 1


@dataclass
class Step:
    """What feeding one object asks of the session."""

    events: list[DriverEvent] = field(default_factory=list)
    send: list[dict[str, Any]] = field(default_factory=list)  # objects to write to the CLI, in order
    outcome: TurnOutcome | None = None  # the turn is over (settled, rejected, no evidence)


class Tracker(ABC):
    """One turn's evidence. Pure: no I/O, no clock, state only from ``start`` and the lines fed."""

    start: TurnStart

    def opening(self, message: str) -> list[dict[str, Any]]:
        """The objects that start the turn and carry ``message`` unchanged."""
        raise NotImplementedError

    @abstractmethod
    def feed(self, obj: dict[str, Any]) -> Step:
        """One object the CLI printed (in stream order; never raises on odd shapes)."""

    #: After a cancellation, must the interrupted turn be read to its end before the process is
    #: consistent? (Codex: a turn/start while a native turn is active would steer it.) Elsewhere a
    #: cancelled turn's tail is left unread: the next tracker drops what belongs to earlier turns.
    drain_on_cancel: bool = False

    @abstractmethod
    def interrupt(self) -> list[dict[str, Any]]:
        """The CLI's native interrupt for this turn: what to send now (may be nothing yet — a
        tracker that cannot address the turn yet sends it from a later :meth:`feed`)."""

    def partial_text(self) -> str:
        """Assistant text streamed so far (for an unsettled outcome)."""
        return ""

    def end_of_stream(self, diagnostics: str) -> NotSettled:
        """The outcome when the stream ends before the turn did."""
        return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=_with_stderr("stream ended before settlement",
                                                                                       diagnostics),
                          assistant_text=self.partial_text())


def _with_stderr(what: str, diagnostics: str) -> str:
    tail = diagnostics.strip().splitlines()[-5:]
    return what + (f"; stderr: {' | '.join(tail)}" if tail else "")


def guarded(emit: EventSink, runtime: str) -> EventSink:
    """``emit`` that can never break a turn: a consumer's exception is logged and dropped."""

    def sink(event: DriverEvent) -> None:
        try:
            emit(event)
        except Exception:  # noqa: BLE001 - a consumer's bug must not break the protocol loop
            log.exception("driver.emit_failed", runtime=runtime, kind=getattr(event, "kind", None))

    return sink


class NativeSession(ABC):
    """One CLI process serving one member: the handshake and turn template."""

    runtime: str  # a class attribute per CLI (one bridge class serves two runtimes per instance)

    def __init__(self, transport: Transport, launch: Launch) -> None:
        self.transport = transport
        self.launch = launch
        self.expected: Locator | None = launch.expected  # the locator this process serves
        self.locator: Locator | None = None  # set once the handshake/turn verified it
        self.cli_version: str | None = None
        self.turns = 0  # settled turns of this process
        self.turn: Tracker | None = None  # the turn in flight
        self.last_start: TurnStart | None = None  # the start of the latest turn (for replay_turn)
        # awaited with each turn's start before its opening is sent (the runner records it next
        # to the keeper offset where the turn begins, so a new daemon can finish the turn)
        self.before_turn: Callable[[TurnStart], Awaitable[None]] | None = None
        self._seq = 0
        # fast_acquire: a free lock is taken without a trip round the event loop (several per turn)
        self._busy = anyio.Lock(fast_acquire=True)
        self._send_lock = anyio.Lock(fast_acquire=True)
        self._log = log.bind(runtime=self.runtime_name)

    @property
    def runtime_name(self) -> str:
        return self.runtime

    # ------------------------------------------------------------ what a CLI supplies

    @property
    def handshake_timeout_s(self) -> float:
        return 60.0

    @property
    def handshake_answer(self) -> str:
        """What the handshake waits for, for its timeout message."""
        return "handshake"

    @property
    def interrupt_grace_s(self) -> float:
        """How long an interrupt and the interrupted turn's end may take (timeout, cancellation)."""
        return 5.0

    @abstractmethod
    async def open(self) -> None:
        """The native handshake: NEW starts the session and sets ``expected`` to the locator
        the CLI established; RESTORED confirms ``launch.expected`` and sets ``locator``.
        Raises :class:`HandshakeFailed` for what the CLI itself said."""

    @abstractmethod
    def turn_start(self) -> TurnStart:
        """The start state of the next turn (ids allocated, what it must verify)."""

    @abstractmethod
    def tracker(self, start: TurnStart) -> Tracker:
        """A fresh tracker for a turn that began with ``start``."""

    def refuse_turn(self) -> NotSettled | None:
        """Why no turn may start on this process now (None: it may)."""
        return None

    async def settled(self, tracker: Tracker, settlement: Settlement) -> TurnOutcome:
        """After the CLI's settlement: anything the CLI needs before it counts (default: nothing)."""
        return settlement

    def turn_ended(self, tracker: Tracker, outcome: TurnOutcome) -> None:
        """Bookkeeping after every turn, settled or not."""

    def launch_failed(self, exc: LaunchError) -> HandshakeFailed:
        """The launcher refused to start the CLI: its precheck reason decides."""
        reason = exc.payload.get("reason")
        if reason in ("missing_file", "bad_header"):
            return HandshakeFailed(HandshakeReason.NATIVE_STATE_MISSING, json.dumps(exc.payload))
        if reason == "header_mismatch":
            return HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH, json.dumps(exc.payload))
        if reason == "model_gate_not_listening":
            return HandshakeFailed(HandshakeReason.MODEL_NOT_LISTENING, json.dumps(exc.payload))
        return HandshakeFailed(HandshakeReason.PROCESS_FAILED, json.dumps(exc.payload))

    async def fork(self, at_turn: int | None = None) -> Locator:
        """Eager fork (drivers whose ``Driver.fork_mode`` is ``"eager"``): branch this session
        keeping its first ``at_turn`` native user turns (all when None); return the new locator."""
        raise ForkFailed(f"{self.runtime_name} forks lazily, when the fork's first turn starts")

    # ------------------------------------------------------------ lines

    async def read_object(self) -> dict[str, Any] | None:
        """Next JSON object from the CLI; None at end of stream. Garbled lines are skipped.

        A ``launch_error`` line from the launcher raises :class:`LaunchError`.
        """
        while True:
            line = await self.transport.receive()
            if line is None:
                return None
            obj = parse_json_line(line)
            if obj is None:
                if line.strip():
                    self._log.debug("driver.skip_line", line=line[:200])
                continue
            if obj.get("type") == "launch_error":
                raise LaunchError(obj)
            return obj

    async def send_object(self, obj: dict[str, Any]) -> None:
        try:
            line = json.dumps(obj, ensure_ascii=False).encode()
        except UnicodeEncodeError:
            # A lone surrogate cannot be UTF-8 encoded raw; as a \uXXXX escape the CLI's JSON
            # parser restores the very same string.
            line = json.dumps(obj, ensure_ascii=True).encode()
        async with self._send_lock:  # interrupt() may write while the turn loop writes
            await self.transport.send(line)

    async def _send_all(self, objs: Iterable[dict[str, Any]]) -> None:
        for obj in objs:
            await self.send_object(obj)

    # ------------------------------------------------------------ the template

    async def handshake(self) -> None:
        """NEW: start the native session. RESTORED: confirm it resumed ``launch.expected``.

        Raises :class:`HandshakeFailed`; the user message is never sent after a failed handshake.
        """
        try:
            with anyio.fail_after(self.handshake_timeout_s):
                await self.open()
        except TimeoutError:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"handshake timed out: no {self.handshake_answer} "
                                  f"response within {self.handshake_timeout_s:g}s") from None
        except LaunchError as exc:
            raise self.launch_failed(exc) from None
        except TransportError as exc:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED,
                                  _with_stderr(f"transport closed: {exc}", self.transport.diagnostics())) from None

    def next_turn(self) -> int:
        self._seq += 1
        return self._seq

    async def run_turn(self, message: str, *, emit: EventSink = discard, timeout_s: float = 600.0) -> TurnOutcome:
        """Send ``message`` unchanged and wait for native settlement (SPEC section 5)."""
        if self._busy.locked():
            return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail="another call is using this session")
        async with self._busy:
            refused = self.refuse_turn()
            if refused is not None:
                return refused
            start = self.turn_start()
            tracker = self.tracker(start)
            self.turn, self.last_start = tracker, start
            if self.before_turn is not None:
                await self.before_turn(start)
            return await self._turn(tracker, tracker.opening(message), guarded(emit, self.runtime_name), timeout_s)

    async def resume_turn(self, start: TurnStart, *, emit: EventSink = discard, timeout_s: float = 600.0,
                          answer: Callable[[], bool] = lambda: True) -> TurnOutcome:
        """Finish a turn another process of this daemon began (a daemon restart under a keeper):
        the transport re-reads the CLI's output from the offset where the turn began, a tracker
        built from ``start`` follows it to the CLI's own settlement, and nothing is re-sent
        (the opening was sent then). What the tracker asks to send is sent only while
        ``answer()`` says so (the caller's judgement of which lines the old daemon never saw)."""
        if self._busy.locked():
            return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail="another call is using this session")
        async with self._busy:
            tracker = self.tracker(start)
            self.turn, self.last_start = tracker, start
            return await self._turn(tracker, [], guarded(emit, self.runtime_name), timeout_s, answer=answer)

    async def _turn(self, tracker: Tracker, opening: list[dict[str, Any]], sink: EventSink, timeout_s: float,
                    answer: Callable[[], bool] = lambda: True) -> TurnOutcome:
        outcome: TurnOutcome | None = None
        try:
            with anyio.move_on_after(timeout_s):
                outcome = await self._drive(tracker, opening, sink, answer)
            if outcome is None:
                await self._interrupt(tracker, sink, until_ended=True)
                outcome = NotSettled(reason=NotSettledReason.TIMEOUT, detail=f"no settlement within {timeout_s:g}s",
                                     assistant_text=tracker.partial_text())
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True):
                await self._interrupt(tracker, sink, until_ended=tracker.drain_on_cancel)
                self.turn_ended(tracker, NotSettled(reason=NotSettledReason.CANCELLED))
                self.turn = None
            raise
        except (TransportError, LaunchError) as exc:
            outcome = NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=str(exc) or "stream ended",
                                 assistant_text=tracker.partial_text())
        if isinstance(outcome, Settlement):
            outcome = await self.settled(tracker, outcome)
        if isinstance(outcome, Settlement):
            self.turns += 1
            self._adopt(outcome)
        self.turn_ended(tracker, outcome)
        self.turn = None
        return outcome

    async def _drive(self, tracker: Tracker, opening: list[dict[str, Any]], sink: EventSink,
                     answer: Callable[[], bool]) -> TurnOutcome:
        await self._send_all(opening)
        while True:
            obj = await self.read_object()
            if obj is None:
                return tracker.end_of_stream(self.transport.diagnostics())
            step = tracker.feed(obj)
            for event in step.events:
                sink(event)
            if answer():
                await self._send_all(step.send)
            if step.outcome is not None:
                return step.outcome

    async def _interrupt(self, tracker: Tracker, sink: EventSink, *, until_ended: bool) -> None:
        """Send the native interrupt (bounded by :attr:`interrupt_grace_s`); with ``until_ended``
        read until the interrupted turn ends, so the native history is consistent (the outcome
        stays unsettled either way)."""
        with anyio.move_on_after(self.interrupt_grace_s):
            try:
                await self._send_all(tracker.interrupt())
                while until_ended and (obj := await self.read_object()) is not None:
                    step = tracker.feed(obj)
                    for event in step.events:
                        sink(event)
                    await self._send_all(step.send)
                    if step.outcome is not None:
                        return
            except (TransportError, LaunchError) as exc:
                self._log.info("driver.interrupt_failed", error=str(exc))

    async def interrupt(self) -> bool:
        """Ask the CLI to interrupt the running turn natively; the running :meth:`run_turn`
        then settles it the CLI's way (usually ``aborted``). False when no turn is running."""
        tracker = self.turn
        if tracker is None:
            return False
        await self._send_all(tracker.interrupt())
        return True

    def _adopt(self, settlement: Settlement) -> None:
        observed = settlement.observed_locator
        if observed is not None and observed == self.expected:
            self.locator = observed
        else:
            self._log.warning("driver.locator_differs", expected=str(self.expected), observed=str(observed))

    # ------------------------------------------------------------ adoption (a daemon restart)

    def snapshot(self) -> dict[str, Any]:
        """What this process's session object knows beyond its stream, as JSON: a new daemon
        re-adopting the process (through its keeper) rebuilds the object with :meth:`restore`
        instead of a handshake."""
        return {"expected": self.expected.model_dump() if self.expected else None,
                "locator": self.locator.model_dump() if self.locator else None,
                "cli_version": self.cli_version, "turns": self.turns, "seq": self._seq, **self.state()}

    def restore(self, snap: dict[str, Any]) -> None:
        self.expected = Locator.model_validate(snap["expected"]) if snap.get("expected") else None
        self.locator = Locator.model_validate(snap["locator"]) if snap.get("locator") else None
        self.cli_version = snap.get("cli_version")
        self.turns = int(snap.get("turns", 0))
        self._seq = int(snap.get("seq", 0))
        self.restore_state(snap)

    def state(self) -> dict[str, Any]:
        """A CLI's own fields for :meth:`snapshot` (JSON values)."""
        return {}

    def restore_state(self, snap: dict[str, Any]) -> None:
        """Set a CLI's own fields from a :meth:`snapshot`."""

    #: the TurnStart model of this CLI (to load one a previous daemon stored)
    start_model: type[TurnStart] = TurnStart

    def load_start(self, data: str) -> TurnStart:
        return self.start_model.model_validate_json(data)

    def replay_turn(self, lines: Iterable[bytes], start: TurnStart | None = None) -> TurnOutcome | None:
        """The outcome a turn's raw output lines reach, fed to a tracker built from ``start``
        (default: the latest turn's). ``lines`` begin at the offset where the turn began (its
        opening was sent there); what the tracker would send is not sent — the recorded lines
        already hold the CLI's answers. None when the lines end before the turn did.
        Post-settlement checks of a live process (Claude's flush window) are not replayed."""
        start = start if start is not None else self.last_start
        if start is None:
            raise ValueError("no turn to replay: pass its TurnStart")
        tracker = self.tracker(start)
        for line in lines:
            obj = parse_json_line(line)
            if obj is None or obj.get("type") == "launch_error":
                continue
            step = tracker.feed(obj)
            if step.outcome is not None:
                return step.outcome
        return None

    async def close(self, grace_s: float = 3.0) -> None:
        """Graceful stop: close stdin and let the CLI exit on EOF."""
        await self.transport.close()
