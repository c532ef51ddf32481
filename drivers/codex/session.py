"""Codex driver: ``codex app-server`` over stdio JSON-RPC (pinned @openai/codex 0.171.0).

Launch, config and model-slug decisions: :mod:`drivers.codex.launch`. Wire parsing and the
settlement rule: :mod:`drivers.codex.wire`. This module holds the session logic.

Identity: the locator is the thread id. A NEW thread id exists right after ``thread/start``
but the thread is only written to disk once a ``turn/start`` succeeded (zero-turn threads
are never persisted, protocols/codex.md §7): ``expected`` is that id from the handshake on (every
turn must report it), ``persisted`` says when it is on disk. RESTORED runs ``thread/resume`` and
must get the same id back. The turn loop is the shared template (drivers/session.py) with
:class:`drivers.codex.wire.CodexTurn` as tracker.
"""

from __future__ import annotations

import glob
import posixpath
from typing import Any

from drivers.base import Driver, ForkFailed, ForkPointMissing, Launch, LaunchError, as_dict
from drivers.codex import launch as plans
from drivers.codex.launch import CodexSettings, codex_home
from drivers.codex.wire import (
    CodexTurn,
    CodexTurnStart,
    Kind,
    answer_server_request,
    kind_of,
    resume_failure,
    rpc_error_message,
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
    TurnOutcome,
)
from drivers.session import NativeSession, Tracker, TurnStart
from drivers.transport import Transport, TransportError

__all__ = ["CodexDriver", "CodexSession", "CodexSettings", "ForkFailed", "resume_failure"]

class CodexSession(NativeSession):
    runtime = "codex"

    def __init__(self, transport: Transport, launch: Launch, settings: CodexSettings | None = None) -> None:
        super().__init__(transport, launch)
        self.settings = settings or CodexSettings()
        self.thread_id: str | None = None  # the thread this process serves (NEW: from thread/start)
        self.persisted = False  # True once a turn/start succeeded: the thread is on disk
        self.turn_ids: list[str] = []  # native turn ids of this process's turns that ended
        self._left_over: str | None = None  # a native turn that never ended: no turn/start may follow
        self._next_id = 0

    @property
    def handshake_timeout_s(self) -> float:
        return self.settings.handshake_timeout_s

    @property
    def handshake_answer(self) -> str:
        return "initialize/thread"

    @property
    def interrupt_grace_s(self) -> float:
        return self.settings.interrupt_grace_s

    @property
    def active_turn(self) -> str | None:
        """The native turn in flight (or left unsettled by an earlier turn of this process)."""
        tracker = self.turn
        if isinstance(tracker, CodexTurn) and tracker.turn_id is not None and not tracker.ended:
            return tracker.turn_id
        return self._left_over

    @active_turn.setter
    def active_turn(self, turn_id: str | None) -> None:
        self._left_over = turn_id

    # ------------------------------------------------------------ JSON-RPC plumbing

    def _allocate(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    async def _request(self, method: str, params: dict[str, Any] | None = None) -> int:
        rid = self._allocate()
        msg: dict[str, Any] = {"method": method, "id": rid}
        if params is not None:
            msg["params"] = params
        await self.send_object(msg)
        return rid

    async def _await_response(self, rid: int) -> dict[str, Any] | None:
        """Read until the response to ``rid``; None at end of stream. Between turns only:
        notifications are dropped, server requests refused at once."""
        while True:
            msg = await self.read_object()
            if msg is None:
                return None
            kind = kind_of(msg)
            if kind is Kind.RESPONSE and msg.get("id") == rid:
                return msg
            if kind is Kind.REQUEST:
                self._log.warning("codex.server_request_refused", method=msg.get("method"), id=msg.get("id"))
                await self.send_object(answer_server_request(msg))

    async def _call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        return await self._await_response(await self._request(method, params))

    def _died(self, what: str) -> str:
        tail = self.transport.diagnostics().strip().splitlines()[-5:]
        return f"{what}: stream ended" + (f"; stderr: {' | '.join(tail)}" if tail else "")

    # ------------------------------------------------------------ handshake

    async def open(self) -> None:
        s = self.settings
        init = await self._call("initialize", {"clientInfo": {"name": s.client_name, "title": "cloud-agent",
                                                              "version": "0.1.0"}})
        if init is None:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, self._died("initialize"))
        if (err := rpc_error_message(init)) is not None:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"initialize: {err}")
        agent = as_dict(init.get("result")).get("userAgent")
        if isinstance(agent, str) and "/" in agent:  # "<clientName>/<codex version> (...)"
            self.cli_version = agent.split(" ", 1)[0].rsplit("/", 1)[-1]
        await self.send_object({"method": "initialized"})

        expected = self.launch.expected
        if not self.launch.resume:
            params = {"cwd": self.launch.spec.cwd, "approvalPolicy": "never", "sandbox": "danger-full-access"}
            resp = await self._call("thread/start", params)
            if resp is None:
                raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, self._died("thread/start"))
            if (err := rpc_error_message(resp)) is not None:
                raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"thread/start: {err}")
            thread_id = as_dict(as_dict(resp.get("result")).get("thread")).get("id")
            if not isinstance(thread_id, str) or not thread_id:
                raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, "thread/start returned no thread id")
            # Not on disk yet (zero-turn threads are never persisted): verifiable after the
            # first successful turn/start; it is the thread every turn must report.
            self.thread_id = thread_id
            self.expected = Locator(id=thread_id)
            self._log = self._log.bind(thread=thread_id)
            return

        if expected is None:
            raise HandshakeFailed(HandshakeReason.NATIVE_STATE_MISSING, "resume without a locator")
        resp = await self._call("thread/resume", {"threadId": expected.id, "excludeTurns": True})
        if resp is None:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, self._died("thread/resume"))
        if (err := rpc_error_message(resp)) is not None:
            raise HandshakeFailed(resume_failure(err), f"thread/resume: {err}")
        thread = as_dict(as_dict(resp.get("result")).get("thread"))
        observed = thread.get("id")
        if observed != expected.id:
            got = Locator(id=observed) if isinstance(observed, str) and observed else None
            raise HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH,
                                  f"thread/resume {expected.id} returned thread {observed!r}", observed=got)
        self.thread_id = expected.id
        self.persisted = True
        self.locator = expected
        self._log = self._log.bind(thread=expected.id)

    # ------------------------------------------------------------ turns (the template: drivers/session.py)

    def refuse_turn(self) -> NotSettled | None:
        if self.thread_id is None:
            return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail="no handshake")
        if self._left_over is not None:
            # A turn/start now would steer the unsettled turn instead of starting one.
            return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR,
                              detail=f"turn {self._left_over} never settled; retire this process")
        return None

    start_model = CodexTurnStart
    #: JSON-RPC ids a previous daemon may have used after its last snapshot (interrupts,
    #: answers): a restored session starts past them, so no id is ever reused
    ID_MARGIN = 1_000_000

    def state(self) -> dict[str, Any]:
        return {"thread_id": self.thread_id, "persisted": self.persisted, "turn_ids": list(self.turn_ids),
                "left_over": self._left_over, "next_id": self._next_id}

    def restore_state(self, snap: dict[str, Any]) -> None:
        self.thread_id = snap.get("thread_id")
        self.persisted = bool(snap.get("persisted"))
        self.turn_ids = list(snap.get("turn_ids") or [])
        self._left_over = snap.get("left_over")
        self._next_id = int(snap.get("next_id", 0)) + self.ID_MARGIN
        if self.thread_id:
            self._log = self._log.bind(thread=self.thread_id)

    def turn_start(self) -> CodexTurnStart:
        assert self.thread_id is not None
        return CodexTurnStart(turn=self.next_turn(), thread_id=self.thread_id, request_id=self._allocate(),
                              known_turns=list(self.turn_ids))

    def tracker(self, start: TurnStart) -> CodexTurn:
        assert isinstance(start, CodexTurnStart)
        return CodexTurn(start, self._allocate)

    def turn_ended(self, tracker: Tracker, outcome: TurnOutcome) -> None:
        assert isinstance(tracker, CodexTurn)
        if tracker.accepted:
            self.persisted = True
        if tracker.turn_id is None:
            return
        if tracker.ended:
            self.turn_ids.append(tracker.turn_id)
        else:
            self._left_over = tracker.turn_id

    # ------------------------------------------------------------ fork

    async def fork(self, at_turn: int | None = None, *, last_turn_id: str | None = None) -> Locator:
        """``thread/fork`` of this session's thread keeping its first ``at_turn`` native turns
        (through ``last_turn_id``, inclusive, when given; everything when neither is). Returns the
        new thread's locator; the fork lives in the same CODEX_HOME.

        Measured on 0.171.0 (tests/cli/test_codex_driver.py): ``lastTurnId`` does fork at a
        historical turn, and the fork's first model request carries exactly that prefix.
        """
        if at_turn is not None and last_turn_id is None:
            ids = await self.list_turn_ids()
            if at_turn < 1 or at_turn > len(ids):
                raise ForkPointMissing(f"at_turn {at_turn} > {len(ids)} native turns")
            last_turn_id = ids[at_turn - 1]
        async with self._busy:
            if self.thread_id is None or not self.persisted:
                raise ForkFailed("nothing to fork: the thread has no settled turn on disk")
            params: dict[str, Any] = {"threadId": self.thread_id, "excludeTurns": True}
            if last_turn_id is not None:
                params["lastTurnId"] = last_turn_id
            try:
                resp = await self._call("thread/fork", params)
            except (TransportError, LaunchError) as exc:
                raise ForkFailed(f"transport closed: {exc}") from exc
            if resp is None:
                raise ForkFailed(self._died("thread/fork"))
            if (err := rpc_error_message(resp)) is not None:
                raise ForkFailed(f"thread/fork: {err}")
            thread = as_dict(as_dict(resp.get("result")).get("thread"))
            new_id, parent = thread.get("id"), thread.get("forkedFromId")
            if not isinstance(new_id, str) or not new_id or new_id == self.thread_id or parent != self.thread_id:
                raise ForkFailed(f"thread/fork returned id={new_id!r} forkedFromId={parent!r}")
            return Locator(id=new_id)

    async def list_turn_ids(self) -> list[str]:
        """Native turn ids of this thread, oldest first (``thread/turns/list``, all pages)."""
        async with self._busy:
            ids: list[str] = []
            cursor: str | None = None
            while True:
                params: dict[str, Any] = {"threadId": self.thread_id, "sortDirection": "asc", "itemsView": "notLoaded"}
                if cursor:
                    params["cursor"] = cursor
                try:
                    resp = await self._call("thread/turns/list", params)
                except (TransportError, LaunchError) as exc:
                    raise ForkFailed(f"transport closed: {exc}") from exc
                if resp is None or (err := rpc_error_message(resp)) is not None:
                    raise ForkFailed(f"thread/turns/list: {self._died('') if resp is None else err}")
                result = as_dict(resp.get("result"))
                data = result.get("data")
                ids += [t["id"] for t in data if isinstance(t, dict) and isinstance(t.get("id"), str)] \
                    if isinstance(data, list) else []
                cursor = result.get("nextCursor") if isinstance(result.get("nextCursor"), str) else None
                if not cursor or not data:
                    return ids


class CodexDriver(Driver):
    runtime = "codex"

    def __init__(self, settings: CodexSettings | None = None, *, options: DriverOptions | None = None,
                 **overrides: Any) -> None:
        self.options = options or DriverOptions()
        base = settings or CodexSettings()
        # re-validated, so overrides obey the same bounds as the settings model
        self.settings = CodexSettings(**{**base.model_dump(), **overrides}) if overrides else base

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        # the compaction policy has no Codex switch (drivers/codex/launch.py): reported, not prevented
        return plans.plan(self.settings, paths, gateway, resume)

    def plan_fork(self, paths: MemberPaths, gateway: GatewayConfig, source: Locator,
                  at_turn: int | None = None) -> Launch:
        """The process that forks ``source`` (use :meth:`CodexSession.fork` after the handshake).

        ``thread/fork`` writes the new rollout into the *source's* CODEX_HOME and Codex must
        never see a relocated home, so ``paths`` are the source member's. If the source has
        a resident process, fork on that session instead: a second process cannot resume a
        thread another live process writes ("already has an active writer").
        """
        return self.plan(paths, gateway, resume=source)

    def session(self, transport: Transport, launch: Launch) -> CodexSession:
        return CodexSession(transport, launch, self.settings)

    @staticmethod
    def codex_home(paths: MemberPaths) -> str:
        return codex_home(paths)

    @staticmethod
    def rollout_glob(paths: MemberPaths, locator: Locator) -> str:
        """Where the thread's rollout lives (date directories are local time of creation)."""
        return posixpath.join(glob.escape(codex_home(paths)), "sessions", "*", "*", "*",
                              f"rollout-*-{glob.escape(locator.id)}.jsonl")

    def native_state(self, paths: MemberPaths, locator: Locator) -> list[str]:
        return [self.rollout_glob(paths, locator)]
