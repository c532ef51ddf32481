"""OpenCode / Kilo sessions over the live bridge: handshake, turns, fork.

Launch plans: :mod:`drivers.bridge.launch`; line parsing and the turn tracker:
:mod:`drivers.bridge.wire`. The bridge's ``settled`` for the active turn id is the only
settlement evidence (SPEC section 5); the turn loop itself is the shared template
(:class:`drivers.session.NativeSession`).
"""

from __future__ import annotations

import glob
from collections.abc import Mapping, Sequence
from typing import Any

import anyio

from drivers.base import Driver, ForkFailed, Launch
from drivers.bridge import launch as plans
from drivers.bridge.launch import BRIDGE_COMMAND, IMAGE_PATH
from drivers.bridge.wire import BridgeTurn, BridgeTurnStart
from drivers.models import DriverOptions, GatewayConfig, HandshakeFailed, HandshakeReason, Locator, MemberPaths
from drivers.session import NativeSession, TurnStart
from drivers.transport import Transport, TransportClosed, TransportError

HANDSHAKE_TIMEOUT_S = 180.0  # server start is CPU-heavy (4-8 s alone; far more on a loaded host)
ABORT_GRACE_S = 10.0  # after a timeout: how long the native abort may take to settle
COMMAND_TIMEOUT_S = 30.0


class BridgeCommandError(ForkFailed):
    """The bridge refused a command between turns (its ``error`` line)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(f"{payload.get('reason')}: {payload.get('detail', '')}")
        self.payload = payload
        self.reason = payload.get("reason")


class BridgeSession(NativeSession):
    runtime = "bridge"

    def __init__(self, transport: Transport, launch: Launch, runtime: str, *, helper_version: int | None = None
                 ) -> None:
        self.runtime = runtime  # one session class serves opencode and kilo
        super().__init__(transport, launch)
        self.pinned_helper = helper_version  # what the bridge's hello must report (a launch input)
        self.session_id: str | None = None  # the native session the bridge opened
        self.helper_version: int | None = None  # what the bridge reported
        self.abort_grace_s = ABORT_GRACE_S

    @property
    def handshake_timeout_s(self) -> float:
        return HANDSHAKE_TIMEOUT_S

    @property
    def handshake_answer(self) -> str:
        return "hello/opened"

    @property
    def interrupt_grace_s(self) -> float:
        return self.abort_grace_s

    # -- handshake

    async def _next(self) -> dict[str, Any]:
        obj = await self.read_object()
        if obj is None:
            raise TransportClosed("the bridge exited")
        return obj

    async def open(self) -> None:
        await self._hello()
        await self._open()

    async def _hello(self) -> None:
        hello = await self._next()
        if hello.get("type") != "hello":
            raise HandshakeFailed(HandshakeReason.PROCESS_FAILED, f"expected hello, got {hello}")
        self.helper_version = hello.get("version") if isinstance(hello.get("version"), int) else None
        want = self.pinned_helper
        if want is None or hello.get("version") != want:
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
        else:
            self.expected = Locator(id=sid)  # NEW: the session the bridge opened is the one to serve
        self._log.info("bridge.opened", session=sid, created=obj.get("created"), cli_version=self.cli_version)

    # -- turns (the template in drivers/session.py; the tracker in drivers/bridge/wire.py)

    start_model = BridgeTurnStart

    def state(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "helper_version": self.helper_version}

    def restore_state(self, snap: dict[str, Any]) -> None:
        self.session_id = snap.get("session_id")
        self.helper_version = snap.get("helper_version")

    def turn_start(self) -> BridgeTurnStart:
        n = self.next_turn()
        return BridgeTurnStart(turn=n, turn_id=f"turn-{n}")

    def tracker(self, start: TurnStart) -> BridgeTurn:
        assert isinstance(start, BridgeTurnStart)
        return BridgeTurn(start, self.runtime)

    # -- fork

    async def fork(self, at_turn: int | None = None, *, message_id: str | None = None,
                   session_id: str | None = None) -> Locator:
        """``POST /session/{id}/fork`` through the bridge: a new session holding the first
        ``at_turn`` user turns (all when None), or the messages strictly BEFORE ``message_id``.
        Between turns only; the fork lives in this member's native store."""
        cmd: dict[str, Any] = {"type": "fork"}
        if message_id is not None:
            cmd["message_id"] = message_id
        if session_id is not None:
            cmd["session_id"] = session_id
        if at_turn is not None:
            cmd["at_turn"] = at_turn
        async with self._busy:
            try:
                with anyio.fail_after(COMMAND_TIMEOUT_S):
                    await self.send_object(cmd)
                    while True:
                        obj = await self.read_object()
                        if obj is None:
                            raise ForkFailed("the bridge exited")
                        if obj.get("type") == "forked" and isinstance(obj.get("session_id"), str):
                            return Locator(id=obj["session_id"])
                        if obj.get("type") == "error":
                            raise BridgeCommandError(obj)
            except TimeoutError:
                raise ForkFailed(f"no fork answer within {COMMAND_TIMEOUT_S:g}s") from None
            except TransportError as exc:
                raise ForkFailed(f"transport closed: {exc}") from exc

    async def fork_at_turn(self, at_turn: int | None = None) -> Locator:
        """Fork this session keeping its first ``at_turn`` user turns (all when None)."""
        return await self.fork(at_turn)

    async def close(self, grace_s: float = 3.0) -> None:
        try:
            await self.send_object({"type": "close"})
        except TransportError:
            pass
        await self.transport.close()


class BridgeDriver(Driver):
    """``BridgeDriver("opencode")`` / ``BridgeDriver("kilo")``.

    ``options`` are the launch inputs of every driver (the pinned helper version the bridge's
    hello must report, the compaction policy); ``bridge_args`` are extra bridge options (tests:
    ``--test-seams``, ``--test-fail-permission-replies N``); ``config_overrides`` are merged into
    the server config (tests: ``{"permission": {"bash": "ask"}}``); ``path`` is the PATH the
    bridge and server see (the image's by default).
    """

    runtime = "bridge"

    def __init__(self, runtime: str, options: DriverOptions | None = None, *, bridge_args: Sequence[str] = (),
                 config_overrides: Mapping[str, Any] | None = None, path: str = IMAGE_PATH,
                 limits: Mapping[str, int] | None = None, bridge_command: Sequence[str] = (BRIDGE_COMMAND,)) -> None:
        if runtime not in ("opencode", "kilo"):
            raise ValueError(f"the bridge drives opencode or kilo, not {runtime!r}")
        self.runtime = runtime  # one driver class, two runtimes
        self.options = options or DriverOptions()
        self.bridge_args = tuple(bridge_args)
        self.config_overrides = dict(config_overrides or {})
        self.path = path
        self.limits = limits
        self.bridge_command = tuple(bridge_command)

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        return plans.plan(self.runtime, paths, gateway, resume, bridge_args=self.bridge_args,
                          config_overrides=self.config_overrides, path=self.path, limits=self.limits,
                          bridge_command=self.bridge_command, compaction=self.options.native_compaction)

    def session(self, transport: Transport, launch: Launch) -> BridgeSession:
        return BridgeSession(transport, launch, self.runtime, helper_version=self.options.helper_version)

    def native_state(self, paths: MemberPaths, locator: Locator) -> list[str]:
        # every session of the server lives in its one SQLite store (and its write-ahead log)
        db = glob.escape(plans.native_db(self.runtime, paths.home))
        return [db, f"{db}-wal"]
