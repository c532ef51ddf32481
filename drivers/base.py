"""The driver interface: one per CLI protocol, no Docker knowledge.

A :class:`Driver` is stateless: it says how to launch its CLI (:meth:`Driver.plan`) and
wraps a started process's :class:`~drivers.transport.Transport` in a
:class:`NativeSession`. The session runs the native handshake (NEW or RESTORED), then
turns: it sends the user message unchanged, emits normalized events, and returns a
:class:`~drivers.models.Settlement` only on the CLI's own evidence — anything else is a
:class:`~drivers.models.NotSettled`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import anyio
import structlog
from pydantic import BaseModel, ConfigDict

from drivers.launch import LaunchSpec
from drivers.models import (
    DriverEvent,
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    NotSettled,
    NotSettledReason,
    TurnOutcome,
)
from drivers.transport import Transport, TransportClosed

log = structlog.get_logger("driver")

EventSink = Callable[[DriverEvent], None]


def discard(_: DriverEvent) -> None:
    return None


class Launch(BaseModel):
    """A launch plan: the spec, and the locator the process must prove it serves.

    ``expected`` is None for a NEW member whose CLI mints its own id (Codex, Pi,
    OpenCode/Kilo); Claude's NEW id is minted by the driver (``--session-id``).
    """

    model_config = ConfigDict(frozen=True)

    spec: LaunchSpec
    expected: Locator | None
    resume: bool


class LaunchError(Exception):
    """The in-sandbox launcher refused to start the CLI (a precheck failed)."""

    def __init__(self, payload: dict[str, Any]) -> None:
        super().__init__(json.dumps(payload))
        self.payload = payload


def parse_json_line(line: bytes) -> dict[str, Any] | None:
    """A JSON object from one protocol line, or None for anything else (never raises)."""
    try:
        obj = json.loads(line)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


# Typed reads of parsed protocol values: a field of the wrong type reads as absent.


def as_dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def as_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


class NativeSession(ABC):
    """One CLI process serving one member."""

    runtime: ClassVar[str]

    def __init__(self, transport: Transport, launch: Launch) -> None:
        self.transport = transport
        self.launch = launch
        self.expected: Locator | None = launch.expected
        self.locator: Locator | None = None  # set once the handshake/turn verified it
        self.cli_version: str | None = None
        self.turns = 0
        self._log = log.bind(runtime=self.runtime)

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
        await self.transport.send(json.dumps(obj, ensure_ascii=False).encode())

    def launch_failed(self, exc: LaunchError) -> HandshakeFailed:
        reason = exc.payload.get("reason")
        if reason in ("missing_file", "bad_header"):
            return HandshakeFailed(HandshakeReason.NATIVE_STATE_MISSING, json.dumps(exc.payload))
        if reason == "header_mismatch":
            return HandshakeFailed(HandshakeReason.LOCATOR_MISMATCH, json.dumps(exc.payload))
        return HandshakeFailed(HandshakeReason.PROCESS_FAILED, json.dumps(exc.payload))

    @abstractmethod
    async def handshake(self) -> None:
        """NEW: start the native session. RESTORED: confirm it resumed ``launch.expected``.

        Raises :class:`~drivers.models.HandshakeFailed`; the user message is never sent
        after a failed handshake.
        """

    @abstractmethod
    async def run_turn(self, message: str, *, emit: EventSink = discard, timeout_s: float = 600.0) -> TurnOutcome:
        """Send ``message`` unchanged and wait for native settlement."""

    async def close(self, grace_s: float = 3.0) -> None:
        """Graceful stop: close stdin and let the CLI exit on EOF."""
        await self.transport.close()

    async def not_settled_on_error(self, exc: BaseException, text: str = "") -> NotSettled:
        if isinstance(exc, TransportClosed):
            return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=str(exc) or "stream ended",
                              assistant_text=text)
        if isinstance(exc, LaunchError):
            return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail=str(exc), assistant_text=text)
        raise exc


class Driver(ABC):
    runtime: ClassVar[str]

    @abstractmethod
    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        """The launch for a NEW member (``resume=None``) or a RESTORED one."""

    @abstractmethod
    def session(self, transport: Transport, launch: Launch) -> NativeSession:
        """Wrap a started process."""


async def wait_closed(transport: Transport, timeout_s: float) -> None:
    """Drain the stream until EOF or ``timeout_s`` (after a graceful close)."""
    with anyio.move_on_after(timeout_s):
        while await transport.receive() is not None:
            pass
