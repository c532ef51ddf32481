"""OpenCode / Kilo sessions over the live bridge: handshake, turns, settlement, fork.

Launch plans: :mod:`drivers.bridge.launch`; line parsing: :mod:`drivers.bridge.wire`. The
bridge's ``settled`` for the active turn id is the only settlement evidence (SPEC section 5).
"""

from __future__ import annotations

from typing import Any

import anyio

from collections.abc import Mapping, Sequence

from drivers.base import Driver, EventSink, Launch, LaunchError, NativeSession, discard
from drivers.bridge import launch as plans
from drivers.bridge.launch import BRIDGE_COMMAND, IMAGE_PATH
from drivers.bridge.wire import _REJECTED, driver_events, settlement_from
from drivers.models import (
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    NotSettled,
    NotSettledReason,
    TextDelta,
    TurnOutcome,
)
from drivers.transport import Transport, TransportClosed

HANDSHAKE_TIMEOUT_S = 180.0  # server start is CPU-heavy (4-8 s alone; far more on a loaded host)
ABORT_GRACE_S = 10.0  # after a timeout: how long the native abort may take to settle
COMMAND_TIMEOUT_S = 30.0


class BridgeCommandError(Exception):
    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(f"{payload.get('reason')}: {payload.get('detail', '')}")
        self.payload = payload
        self.reason = payload.get("reason")


def pinned_helper_version() -> int:
    from images.pins import load_pins

    return load_pins().helper.version


class BridgeSession(NativeSession):
    runtime = "bridge"

    def __init__(self, transport: Transport, launch: Launch, runtime: str) -> None:
        self.runtime = runtime  # type: ignore[misc] - set before the base class binds the logger
        super().__init__(transport, launch)
        self.session_id: str | None = None  # the native session the bridge opened
        self.helper_version: int | None = None
        self.abort_grace_s = ABORT_GRACE_S

    # -- handshake
    async def handshake(self) -> None:
        try:
            with anyio.fail_after(HANDSHAKE_TIMEOUT_S):
                await self._hello()
                await self._open()
        except TimeoutError as exc:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, "the bridge did not answer in time") from exc
        except LaunchError as exc:
            raise self.launch_failed(exc) from exc
        except TransportClosed as exc:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"{exc}: {self.transport.diagnostics()[-2000:]}") from exc

    async def _next(self) -> dict[str, Any]:
        obj = await self.read_object()
        if obj is None:
            raise TransportClosed("the bridge exited")
        return obj

    async def _hello(self) -> None:
        hello = await self._next()
        if hello.get("type") != "hello":
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"expected hello, got {hello}")
        self.helper_version = hello.get("version") if isinstance(hello.get("version"), int) else None
        want = pinned_helper_version()
        if hello.get("version") != want:
            raise HandshakeFailed(HandshakeReason.HELPER_VERSION,
                                  f"bridge version {hello.get('version')!r}, pinned {want}")
        if hello.get("runtime") != self.runtime:
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"bridge serves {hello.get('runtime')!r}")
        self.cli_version = hello.get("cli_version") if isinstance(hello.get("cli_version"), str) else None

    async def _open(self) -> None:
        cmd: dict[str, Any] = {"type": "open"}
        if self.expected is not None:
            cmd["session_id"] = self.expected.id
        await self.send_object(cmd)
        while True:
            obj = await self._next()
            if obj.get("type") == "opened":
                break
            if obj.get("type") == "error":
                if obj.get("reason") == "not_found":
                    raise HandshakeFailed(HandshakeReason.NATIVE_STATE_MISSING, str(obj.get("detail") or ""))
                raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"{obj.get('reason')}: {obj.get('detail')}")
        sid = obj.get("session_id")
        if not isinstance(sid, str):
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"opened without a session id: {obj}")
        if self.expected is not None and (sid != self.expected.id or obj.get("created")):
            raise HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH, f"opened {sid}, expected {self.expected.id}",
                                  observed=Locator(id=sid))
        self.session_id = sid
        if self.expected is not None:
            self.locator = self.expected  # the resume handshake confirmed it
        self._log.info("bridge.opened", session=sid, created=obj.get("created"), cli_version=self.cli_version)

    # -- turns
    async def run_turn(self, message: str, *, emit: EventSink = discard, timeout_s: float = 600.0) -> TurnOutcome:
        self.turns += 1
        turn_id = f"turn-{self.turns}"
        text: list[str] = []
        try:
            await self.send_object({"type": "prompt", "turn_id": turn_id, "text": message})
            with anyio.fail_after(timeout_s):
                return await self._until_settled(turn_id, emit, text)
        except TimeoutError:
            await self._abort(turn_id)
            return NotSettled(reason=NotSettledReason.TIMEOUT, detail=f"no native settlement within {timeout_s}s",
                              assistant_text="".join(text))
        except anyio.get_cancelled_exc_class():
            with anyio.CancelScope(shield=True), anyio.move_on_after(2.0):
                try:
                    await self.send_object({"type": "abort"})
                except TransportClosed:
                    pass
            raise
        except (TransportClosed, LaunchError) as exc:
            return await self.not_settled_on_error(exc, "".join(text))

    async def _until_settled(self, turn_id: str, emit: EventSink, text: list[str]) -> TurnOutcome:
        started: set[str] = set()
        while True:
            obj = await self.read_object()
            if obj is None:
                return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED,
                                  detail=f"the bridge exited: {self.transport.diagnostics()[-1000:]}",
                                  assistant_text="".join(text))
            kind = obj.get("type")
            if obj.get("turn_id") not in (None, turn_id):
                continue  # a late line of an earlier turn
            if kind == "settled" and obj.get("turn_id") == turn_id:
                settlement = settlement_from(obj, self.runtime)
                if self.expected is None or settlement.observed_locator == self.expected:
                    self.locator = settlement.observed_locator
                return settlement
            if kind == "error":
                outcome = self._error_outcome(obj, text)
                if outcome is not None:
                    return outcome
                continue
            for ev in driver_events(obj, started):
                if isinstance(ev, TextDelta):
                    text.append(ev.text)
                emit(ev)

    def _error_outcome(self, obj: dict[str, Any], text: list[str]) -> NotSettled | None:
        reason, detail = obj.get("reason"), f"{obj.get('reason')}: {obj.get('detail', '')}"
        if reason in ("stream_lost", "server_exited"):
            return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=detail, assistant_text="".join(text))
        if reason in _REJECTED and obj.get("turn_id") is not None:
            return NotSettled(reason=NotSettledReason.COMMAND_REJECTED, detail=detail, assistant_text="".join(text))
        self._log.warning("bridge.error", reason=reason, detail=obj.get("detail"))
        return None

    async def _abort(self, turn_id: str) -> None:
        """Timeout: interrupt the native turn and give it a moment to end (the result is not used)."""
        with anyio.move_on_after(self.abort_grace_s):
            try:
                await self.send_object({"type": "abort"})
                while (obj := await self.read_object()) is not None:
                    if obj.get("turn_id") == turn_id and obj.get("type") in ("settled", "error"):
                        return
            except (TransportClosed, LaunchError):
                return

    # -- fork (for later: branch a chat at a message)
    async def fork_at_turn(self, at_turn: int | None = None) -> Locator:
        """Fork this session keeping its first ``at_turn`` user turns (all when None)."""
        return await self.fork(session_id=None, at_turn=at_turn)

    async def fork(self, message_id: str | None = None, session_id: str | None = None,
                   at_turn: int | None = None) -> Locator:
        """``POST /session/{id}/fork``: a new session holding the messages strictly BEFORE
        ``message_id`` (all of them without one). Between turns only."""
        cmd: dict[str, Any] = {"type": "fork"}
        if message_id is not None:
            cmd["message_id"] = message_id
        if session_id is not None:
            cmd["session_id"] = session_id
        if at_turn is not None:
            cmd["at_turn"] = at_turn
        with anyio.fail_after(COMMAND_TIMEOUT_S):
            await self.send_object(cmd)
            while True:
                obj = await self.read_object()
                if obj is None:
                    raise TransportClosed("the bridge exited")
                if obj.get("type") == "forked" and isinstance(obj.get("session_id"), str):
                    return Locator(id=obj["session_id"])
                if obj.get("type") == "error":
                    raise BridgeCommandError(obj)

    async def close(self, grace_s: float = 3.0) -> None:
        try:
            await self.send_object({"type": "close"})
        except TransportClosed:
            pass
        await self.transport.close()


class BridgeDriver(Driver):
    """``BridgeDriver("opencode")`` / ``BridgeDriver("kilo")``.

    ``bridge_args`` are extra bridge options (tests: ``--test-seams``,
    ``--test-fail-permission-replies N``); ``config_overrides`` are merged into the server
    config (tests: ``{"permission": {"bash": "ask"}}``); ``path`` is the PATH the bridge
    and server see (the image's by default).
    """

    runtime = "bridge"

    def __init__(self, runtime: str, *, bridge_args: Sequence[str] = (),
                 config_overrides: Mapping[str, Any] | None = None, path: str = IMAGE_PATH,
                 limits: Mapping[str, int] | None = None, bridge_command: Sequence[str] = (BRIDGE_COMMAND,)) -> None:
        if runtime not in ("opencode", "kilo"):
            raise ValueError(f"the bridge drives opencode or kilo, not {runtime!r}")
        self.runtime = runtime  # type: ignore[misc] - one driver class, two runtimes
        self.bridge_args = tuple(bridge_args)
        self.config_overrides = dict(config_overrides or {})
        self.path = path
        self.limits = limits
        self.bridge_command = tuple(bridge_command)

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        return plans.plan(self.runtime, paths, gateway, resume, bridge_args=self.bridge_args,
                          config_overrides=self.config_overrides, path=self.path, limits=self.limits,
                          bridge_command=self.bridge_command)

    def session(self, transport: Transport, launch: Launch) -> BridgeSession:
        return BridgeSession(transport, launch, self.runtime)
