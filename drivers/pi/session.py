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

import glob
from typing import Any

from drivers.base import Driver, ForkFailed, Launch, LaunchError, as_dict, as_list
from drivers.models import (
    DriverOptions,
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    TurnOutcome,
)
from drivers.pi import launch as plans
from drivers.pi.launch import PiSettings, planned_path, sessions_dir
from drivers.pi.wire import PiTracker, PiTurnStart, state_locator
from drivers.session import NativeSession, Tracker, TurnStart
from drivers.transport import Transport, TransportError

__all__ = ["ForkFailed", "PiDriver", "PiSession", "PiSettings"]


class PiSession(NativeSession):
    runtime = "pi"

    def __init__(self, transport: Transport, launch: Launch, settings: PiSettings | None = None) -> None:
        super().__init__(transport, launch)
        self.settings = settings or PiSettings()
        self.reported: Locator | None = None  # what get_state said at the handshake (NEW: not on disk yet)
        self.persisted = launch.resume  # the session file exists (RESTORED, or after an assistant message_end)
        self._id_n = 0  # the last command id number used (a plain int: it is part of the snapshot)

    @property
    def handshake_timeout_s(self) -> float:
        return self.settings.handshake_timeout_s

    @property
    def handshake_answer(self) -> str:
        return "get_state"

    @property
    def interrupt_grace_s(self) -> float:
        return self.settings.abort_grace_s

    # ------------------------------------------------------------ plumbing

    def _next_id(self, prefix: str) -> str:
        self._id_n += 1
        return f"{prefix}{self._id_n}"

    async def _command(self, ctype: str, **fields: Any) -> dict[str, Any] | None:
        """Send one command and wait for its response; None if the stream ended first.

        Only for idle moments (handshake, fork): events read meanwhile are dropped.
        """
        cid = self._next_id(ctype[:2])
        await self.send_object({"id": cid, "type": ctype, **fields})
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

    async def open(self) -> None:
        resp = await self._command("get_state")
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
            self.expected = observed  # the session pi created at the planned path
        self._log.info("pi.handshake", locator=str(observed), resume=self.launch.resume)

    # ------------------------------------------------------------ turns (the template: drivers/session.py)

    start_model = PiTurnStart

    def state(self) -> dict[str, Any]:
        return {"reported": self.reported.model_dump() if self.reported else None, "persisted": self.persisted,
                "id_n": self._id_n}

    def restore_state(self, snap: dict[str, Any]) -> None:
        self.reported = Locator.model_validate(snap["reported"]) if snap.get("reported") else None
        self.persisted = bool(snap.get("persisted"))
        self._id_n = int(snap.get("id_n", 0))

    def turn_start(self) -> PiTurnStart:
        return PiTurnStart(turn=self.next_turn(), prompt_id=self._next_id("p"))

    def tracker(self, start: TurnStart) -> PiTracker:
        assert isinstance(start, PiTurnStart)
        return PiTracker(start)

    def turn_ended(self, tracker: Tracker, outcome: TurnOutcome) -> None:
        assert isinstance(tracker, PiTracker)
        if tracker.turn.assistant_ended:
            self.persisted = True  # pi flushes the session file on the first assistant message_end

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
            except (TransportError, LaunchError) as exc:
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

    fork_home = "new"  # the fork file goes to the new member's own sessions dir

    def __init__(self, settings: PiSettings | None = None, *, options: DriverOptions | None = None,
                 **overrides: Any) -> None:
        self.options = options or DriverOptions()
        base = settings or PiSettings()
        self.settings = base.model_copy(update=overrides) if overrides else base

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        return plans.plan(self.settings, paths, gateway, resume, compaction=self.options.native_compaction)

    def native_state(self, paths: MemberPaths, locator: Locator) -> list[str]:
        # the session file's path is the locator's (the CLI reports it)
        return [glob.escape(locator.path)] if locator.path else []

    def plan_fork(self, paths: MemberPaths, gateway: GatewayConfig, source: Locator,
                  at_turn: int | None = None) -> Launch:
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
