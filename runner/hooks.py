"""Test-only seams of the turn path (never set in production: the daemon has no way to set them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from drivers.transport import Transport
from images.pins import Pins
from telemetry.turn_trace import TurnTrace


@dataclass
class TestHooks:
    """Test-only seams. Never set in production (the daemon has no way to set them)."""

    wrap_transport: Callable[[Transport, str], Transport] | None = None
    disable_retire_after: bool = False
    lease_paused: Callable[[], bool] | None = None  # a fleet host's heartbeat pauses while True
    # the model proxy rewrites a request body before auditing and forwarding it (route name, body)
    rewrite_model_request: Callable[[str, bytes], bytes] | None = None
    # bench mode (issue 16): each submitted job gets a TurnTrace of per-phase marks, handed here
    turn_trace: Callable[[TurnTrace], None] | None = None
    # the pins the configured image must carry (an upgrade test's second pins file, SPEC 15);
    # the product's own are images/pins.toml
    pins: Pins | None = None
