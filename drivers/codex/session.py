"""Codex driver: ``codex app-server`` over stdio JSON-RPC (pinned @openai/codex 0.171.0).

Launch, config and model-slug decisions: :mod:`drivers.codex.launch`. Wire parsing and the
settlement rule: :mod:`drivers.codex.wire`. This module holds the session logic.

Identity: the locator is the thread id. A NEW thread id exists right after ``thread/start``
but the thread is only written to disk once a ``turn/start`` succeeded (zero-turn threads
are never persisted, protocols/codex.md §7), so ``expected`` stays None until the first
settled turn reports it. RESTORED runs ``thread/resume`` and must get the same id back.
"""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

import anyio

from drivers.base import Driver, EventSink, Launch, LaunchError, NativeSession, as_dict, discard
from drivers.codex import launch as plans
from drivers.codex.launch import CodexSettings, codex_home
from drivers.codex.wire import (
    Kind,
    TurnTracker,
    answer_server_request,
    kind_of,
    resume_failure,
    rpc_error_message,
)
from drivers.models import (
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    Notice,
    NotSettled,
    NotSettledReason,
    TurnOutcome,
)
from drivers.transport import Transport, TransportClosed

__all__ = ["CodexDriver", "CodexSession", "CodexSettings", "ForkFailed", "resume_failure"]

Handler = Callable[[dict[str, Any]], None]


class ForkFailed(Exception):
    """``thread/fork`` was refused or answered with something that is not a fork of ours."""


class CodexSession(NativeSession):
    runtime = "codex"

    def __init__(self, transport: Transport, launch: Launch, settings: CodexSettings | None = None) -> None:
        super().__init__(transport, launch)
        self.settings = settings or CodexSettings()
        self.thread_id: str | None = None  # the locator candidate (unverified before a turn settles)
        self.persisted = False  # True once a turn/start succeeded: the thread is on disk
        self.active_turn: str | None = None
        self.turn_ids: list[str] = []  # native turn ids this process saw settle (for fork)
        self._next_id = 0
        self._ignored: set[int] = set()  # ids of requests whose answers nobody waits for
        self._send_lock = anyio.Lock()
        self._busy = anyio.Lock()

    # ------------------------------------------------------------ JSON-RPC plumbing

    async def _request(self, method: str, params: dict[str, Any] | None = None) -> int:
        rid = self._next_id
        self._next_id += 1
        msg: dict[str, Any] = {"method": method, "id": rid}
        if params is not None:
            msg["params"] = params
        async with self._send_lock:
            await self.send_object(msg)
        return rid

    async def _notify(self, method: str) -> None:
        async with self._send_lock:
            await self.send_object({"method": method})

    async def _answer(self, msg: dict[str, Any], emit: EventSink) -> None:
        """Refuse a server-initiated request at once; a pending one would stall the turn."""
        reply = answer_server_request(msg)
        self._log.warning("codex.server_request_refused", method=msg.get("method"), id=msg.get("id"),
                          reply=reply.get("result") or reply.get("error"))
        async with self._send_lock:
            await self.send_object(reply)
        emit(Notice(name="server_request_refused", detail=str(msg.get("method")), raw=msg))

    async def _await_response(self, rid: int, on_notification: Handler, emit: EventSink = discard
                              ) -> dict[str, Any] | None:
        """Read until the response to ``rid``; None at end of stream."""
        while True:
            msg = await self.read_object()
            if msg is None:
                return None
            kind = kind_of(msg)
            if kind is Kind.RESPONSE and msg.get("id") == rid:
                return msg
            if kind is Kind.REQUEST:
                await self._answer(msg, emit)
            elif kind is Kind.NOTIFICATION:
                on_notification(msg)
            elif kind is Kind.RESPONSE and msg.get("id") not in self._ignored:
                self._log.debug("codex.stray_response", id=msg.get("id"))

    async def _call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any] | None:
        return await self._await_response(await self._request(method, params), lambda _m: None)

    def _died(self, what: str) -> str:
        tail = self.transport.diagnostics().strip().splitlines()[-5:]
        return f"{what}: stream ended" + (f"; stderr: {' | '.join(tail)}" if tail else "")

    # ------------------------------------------------------------ handshake

    async def handshake(self) -> None:
        async with self._busy:
            try:
                with anyio.fail_after(self.settings.handshake_timeout_s):
                    await self._handshake()
            except TimeoutError:
                raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, "handshake timed out") from None
            except LaunchError as exc:
                raise self.launch_failed(exc) from None
            except TransportClosed as exc:
                raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"transport closed: {exc}") from None

    async def _handshake(self) -> None:
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
        await self._notify("initialized")

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
            self.thread_id = thread_id  # not yet on disk: verifiable after the first turn/start
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

    # ------------------------------------------------------------ turns

    async def run_turn(self, message: str, *, emit: EventSink = discard, timeout_s: float = 600.0) -> TurnOutcome:
        if self._busy.locked():
            return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail="another call is using this session")
        async with self._busy:
            if self.thread_id is None:
                return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail="no handshake")
            if self.active_turn is not None:
                # A turn/start now would steer the unsettled turn instead of starting one.
                return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR,
                                  detail=f"turn {self.active_turn} never settled; retire this process")
            state = _TurnState()
            try:
                with anyio.move_on_after(timeout_s) as scope:
                    return await self._turn(message, state, emit)
                if scope.cancelled_caught:
                    await self._stop_turn(state, emit)
                    return NotSettled(reason=NotSettledReason.TIMEOUT, detail=f"no settlement within {timeout_s}s",
                                      assistant_text=state.text)
                raise AssertionError("unreachable")  # pragma: no cover
            except anyio.get_cancelled_exc_class():
                with anyio.CancelScope(shield=True):
                    await self._stop_turn(state, emit)
                raise
            except (TransportClosed, LaunchError) as exc:
                return await self.not_settled_on_error(exc, state.text)

    async def _turn(self, message: str, state: "_TurnState", emit: EventSink) -> TurnOutcome:
        assert self.thread_id is not None
        early: list[dict[str, Any]] = []  # notifications that beat the turn/start response
        state.rid = await self._request("turn/start", {
            "threadId": self.thread_id, "input": [{"type": "text", "text": message}]})
        resp = await self._await_response(state.rid, early.append, emit)
        if resp is None:
            return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=self._died("turn/start"))
        if (err := rpc_error_message(resp)) is not None:
            return NotSettled(reason=NotSettledReason.COMMAND_REJECTED, detail=f"turn/start: {err}")
        turn_id = as_dict(as_dict(resp.get("result")).get("turn")).get("id")
        if not isinstance(turn_id, str) or not turn_id:
            return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR, detail="turn/start returned no turn id")
        if turn_id == self.active_turn or turn_id in self.turn_ids:
            return NotSettled(reason=NotSettledReason.PROTOCOL_ERROR,
                              detail=f"turn/start returned known turn {turn_id} (steered, not started)")
        self.active_turn = turn_id
        self.persisted = True
        state.tracker = tracker = TurnTracker(self.thread_id, turn_id)
        for msg in early:
            for ev in tracker.feed(msg):
                emit(ev)
        while tracker.settlement is None:
            msg = await self.read_object()
            if msg is None:
                return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=self._died("turn"),
                                  assistant_text=tracker.streamed_text)
            kind = kind_of(msg)
            if kind is Kind.REQUEST:
                await self._answer(msg, emit)
                continue
            for ev in tracker.feed(msg):
                emit(ev)
        return self._settled(tracker)

    def _settled(self, tracker: TurnTracker) -> TurnOutcome:
        settlement = tracker.settlement
        assert settlement is not None
        self.active_turn = None
        self.turn_ids.append(tracker.turn_id)
        self.turns += 1
        observed = settlement.observed_locator
        if observed is not None and observed.id == self.thread_id:
            self.locator = observed
            if self.expected is None:
                self.expected = observed
        else:
            self._log.warning("codex.locator_differs", observed=str(observed))
        return settlement

    async def _stop_turn(self, state: "_TurnState", emit: EventSink) -> None:
        """Timeout/cancel: interrupt the native turn and give it a bounded grace to end."""
        with anyio.move_on_after(self.settings.interrupt_grace_s):
            try:
                if state.tracker is None and state.rid is not None:
                    early: list[dict[str, Any]] = []
                    resp = await self._await_response(state.rid, early.append)
                    turn_id = as_dict(as_dict((resp or {}).get("result")).get("turn")).get("id")
                    if not isinstance(turn_id, str) or self.thread_id is None:
                        return
                    self.active_turn = turn_id
                    state.tracker = TurnTracker(self.thread_id, turn_id)
                    for msg in early:
                        state.tracker.feed(msg)
                tracker = state.tracker
                if tracker is None or tracker.settlement is not None:
                    return
                self._ignored.add(await self._request("turn/interrupt", {"threadId": tracker.thread_id,
                                                                         "turnId": tracker.turn_id}))
                while tracker.settlement is None:
                    msg = await self.read_object()
                    if msg is None:
                        return
                    if kind_of(msg) is Kind.REQUEST:
                        await self._answer(msg, emit)
                    else:
                        tracker.feed(msg)
                self.active_turn = None  # it ended (interrupted); still not this turn's settlement
            except (TransportClosed, LaunchError) as exc:
                self._log.info("codex.interrupt_failed", error=str(exc))

    async def interrupt(self) -> bool:
        """Ask Codex to interrupt the active turn (``turn/interrupt``); the running
        :meth:`run_turn` then settles it as ``aborted``. False when no turn is active."""
        turn, thread = self.active_turn, self.thread_id
        if turn is None or thread is None:
            return False
        self._ignored.add(await self._request("turn/interrupt", {"threadId": thread, "turnId": turn}))
        return True

    # ------------------------------------------------------------ fork

    async def fork(self, *, last_turn_id: str | None = None) -> Locator:
        """``thread/fork`` of this session's thread, through ``last_turn_id`` (inclusive) when
        given. Returns the new thread's locator; the fork lives in the same CODEX_HOME.

        Measured on 0.171.0 (tests/cli/test_codex_driver.py): ``lastTurnId`` does fork at a
        historical turn, and the fork's first model request carries exactly that prefix.
        """
        async with self._busy:
            if self.thread_id is None or not self.persisted:
                raise ForkFailed("nothing to fork: the thread has no settled turn on disk")
            params: dict[str, Any] = {"threadId": self.thread_id, "excludeTurns": True}
            if last_turn_id is not None:
                params["lastTurnId"] = last_turn_id
            try:
                resp = await self._call("thread/fork", params)
            except (TransportClosed, LaunchError) as exc:
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
                resp = await self._call("thread/turns/list", params)
                if resp is None or (err := rpc_error_message(resp)) is not None:
                    raise ForkFailed(f"thread/turns/list: {self._died('') if resp is None else err}")
                result = as_dict(resp.get("result"))
                data = result.get("data")
                ids += [t["id"] for t in data if isinstance(t, dict) and isinstance(t.get("id"), str)] \
                    if isinstance(data, list) else []
                cursor = result.get("nextCursor") if isinstance(result.get("nextCursor"), str) else None
                if not cursor or not data:
                    return ids


class _TurnState:
    """What a turn in flight knows, so timeout/cancel can interrupt it."""

    def __init__(self) -> None:
        self.rid: int | None = None
        self.tracker: TurnTracker | None = None

    @property
    def text(self) -> str:
        return self.tracker.streamed_text if self.tracker is not None else ""


class CodexDriver(Driver):
    runtime = "codex"

    def __init__(self, settings: CodexSettings | None = None, **overrides: Any) -> None:
        base = settings or CodexSettings()
        # re-validated, so overrides obey the same bounds as the settings model
        self.settings = CodexSettings(**{**base.model_dump(), **overrides}) if overrides else base

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        return plans.plan(self.settings, paths, gateway, resume)

    def plan_fork(self, paths: MemberPaths, gateway: GatewayConfig, source: Locator) -> Launch:
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
        return posixpath.join(codex_home(paths), "sessions", "*", "*", "*", f"rollout-*-{locator.id}.jsonl")
