"""The driver interface: one per CLI protocol, no Docker knowledge.

A :class:`Driver` is stateless: it says how to launch its CLI (:meth:`Driver.plan`,
:meth:`Driver.plan_fork`) and wraps a started process's :class:`~drivers.transport.Transport`
in a :class:`~drivers.session.NativeSession` (the turn template). The session runs the native
handshake (NEW or RESTORED), then turns: it sends the user message unchanged, emits normalized
events, and returns a :class:`~drivers.models.Settlement` only on the CLI's own evidence —
anything else is a :class:`~drivers.models.NotSettled`.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import anyio
from pydantic import BaseModel, ConfigDict

from drivers.launch import LaunchSpec
from drivers.models import DriverEvent, GatewayConfig, Locator, MemberPaths
from drivers.transport import Transport

if TYPE_CHECKING:
    from drivers.session import NativeSession

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


class ForkFailed(Exception):
    """A native fork was refused or did not yield a new session of ours."""


class ForkPointMissing(ForkFailed):
    """The session has fewer native turns than the fork point asks to keep."""


ForkMode = Literal["eager", "lazy"]


class Driver(ABC):
    """How one CLI is launched and wrapped; stateless.

    Forks: ``fork_mode`` ``"eager"`` — the runner starts :meth:`plan_fork`'s process, runs the
    handshake and :meth:`NativeSession.fork`, and saves the returned locator; ``"lazy"`` — the
    CLI forks by itself when the fork's first turn starts with :meth:`plan_fork`'s launch
    (Claude writes nothing until a message arrives). ``fork_home`` says whose member home the
    fork process runs in and the fork's native state lives in: the source member's, or the new
    member's own.
    """

    runtime: str  # a class attribute per CLI (one bridge class serves two runtimes per instance)
    fork_mode: ClassVar[ForkMode] = "eager"
    fork_home: ClassVar[Literal["source", "new"]] = "source"

    @abstractmethod
    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        """The launch for a NEW member (``resume=None``) or a RESTORED one."""

    def plan_fork(self, paths: MemberPaths, gateway: GatewayConfig, parent: Locator, at_turn: int | None) -> Launch:
        """The process that forks ``parent`` keeping its first ``at_turn`` native turns (all when
        None), in ``paths`` (per ``fork_home``). Eager default: resume the parent; the session's
        :meth:`~drivers.session.NativeSession.fork` makes the fork."""
        return self.plan(paths, gateway, resume=parent)

    @abstractmethod
    def session(self, transport: Transport, launch: Launch) -> NativeSession:
        """Wrap a started process."""

    def native_state(self, paths: MemberPaths, locator: Locator) -> list[str]:
        """Where the CLI keeps ``locator``'s native session state, as glob patterns over the
        sandbox's files (a plain path is :func:`glob.escape`-d). The inspector lists what they
        match; nothing reads them. Default: nothing to look for."""
        return []


async def wait_closed(transport: Transport, timeout_s: float) -> None:
    """Drain the stream until EOF or ``timeout_s`` (after a graceful close)."""
    with anyio.move_on_after(timeout_s):
        while await transport.receive() is not None:
            pass


def __getattr__(name: str) -> Any:
    # ``from drivers.base import NativeSession`` keeps working: the class (the turn template)
    # lives in drivers.session, which imports this module.
    if name == "NativeSession":
        from drivers.session import NativeSession

        return NativeSession
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
