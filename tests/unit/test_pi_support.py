"""Shared helpers of the pi unit tests: recorded streams and a session over a replay."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from drivers.base import Launch
from drivers.launch import LaunchSpec
from drivers.models import DriverEvent, Locator
from drivers.pi import PiSession, PiSettings
from tests.support.pi_replay import ScriptedPiTransport
from tests.support.replay import Entry, load_stream

DATA = Path(__file__).resolve().parent.parent / "data" / "pi"
RECORDINGS = ("tool_call", "terminal_400", "retry_success", "retry_exhausted", "abort", "overflow_stale")


def recording(name: str) -> list[Entry]:
    return load_stream(DATA / f"{name}.jsonl")


def first_state(entries: list[Entry]) -> dict[str, Any]:
    for direction, line in entries:
        obj = json.loads(line)
        if direction == "out" and obj.get("command") == "get_state":
            return obj["data"]
    raise AssertionError("recording has no get_state answer")


def recorded_locator(entries: list[Entry]) -> Locator:
    data = first_state(entries)
    return Locator(id=data["sessionId"], path=data["sessionFile"])


def launch_for(locator: Locator, *, resume: bool = False) -> Launch:
    spec = LaunchSpec(runtime="pi", argv=["pi", "--mode", "rpc", "--session", locator.path or ""], cwd="/w")
    return Launch(spec=spec, expected=locator if resume else None, resume=resume)


def replay_session(entries: list[Entry] | list[bytes], *, resume_locator: Locator | None = None,
                   new_locator: Locator | None = None, **transport_kw: Any) -> tuple[PiSession, ScriptedPiTransport]:
    transport = ScriptedPiTransport(entries, **transport_kw)
    if resume_locator is not None:
        launch = launch_for(resume_locator, resume=True)
    else:
        launch = launch_for(new_locator or recorded_locator(entries))  # type: ignore[arg-type]
    return PiSession(transport, launch, PiSettings(handshake_timeout_s=5, abort_grace_s=1)), transport


class Sink:
    def __init__(self) -> None:
        self.events: list[DriverEvent] = []

    def __call__(self, event: DriverEvent) -> None:
        self.events.append(event)

    def kinds(self) -> list[str]:
        return [e.kind for e in self.events]

    def text(self) -> str:
        return "".join(e.text for e in self.events if e.kind == "text")
