"""The shared turn template (drivers/session.py) over every CLI's REAL recorded streams.

* **Re-feedable trackers**: every recorded turn is run live (replay transport), the raw lines the
  session read from the turn's start on are kept, and ``session.replay_turn(lines, start)`` — a
  fresh tracker built from the turn's (JSON round-tripped) start, fed those lines and nothing
  else — must reach the very same outcome. A later turn replays from its own offset, as a daemon
  restarted over an in-sandbox keeper would re-read it.
* **Guarded emit**: an event callback that raises on every event changes nothing about a turn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest

from drivers.bridge.session import BridgeSession
from drivers.models import NotSettled, NotSettledReason, Settlement, TurnOutcome
from drivers.session import NativeSession
from drivers.transport import Transport, TransportWrapper
from tests.support.bridge_replay import load_trace, recorded_outputs
from tests.unit.test_bridge_session import HELLO
from tests.unit.test_bridge_session import session as bridge_session
from tests.unit.test_claude_replay import load_stream as claude_stream
from tests.unit.test_claude_replay import make_session as claude_session
from tests.unit.test_codex_session import session as codex_session
from tests.unit.test_codex_session import stream as codex_stream
from tests.unit.test_pi_support import recording as pi_recording
from tests.unit.test_pi_support import replay_session as pi_session

pytestmark = pytest.mark.anyio
DATA_BRIDGE = "tests/data/bridge"


class Tap(TransportWrapper):
    """Keeps every line the session received."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.lines: list[bytes] = []

    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        if line is not None:
            self.lines.append(line)
        return line


def claude(name: str) -> NativeSession:
    header, steps = claude_stream(name)
    return claude_session(steps, header["expected"])[0]


def codex(name: str) -> NativeSession:
    return codex_session(codex_stream(name))[0]


def pi(name: str) -> NativeSession:
    return pi_session(pi_recording(name))[0]


def bridge(name: str) -> NativeSession:
    records = load_trace(f"{DATA_BRIDGE}/{name}.jsonl")
    runtime = "kilo" if "kilo" in name else "opencode"
    lines = [HELLO | {"runtime": runtime}, *recorded_outputs(records)]
    s = bridge_session(lines, runtime=runtime)[0]
    assert isinstance(s, BridgeSession)
    return s


CASES: list[tuple[Callable[[str], NativeSession], str]] = [
    *[(claude, n) for n in ("success", "live", "tool", "retry", "failure_400", "context_400", "child_agent",
                            "background_origin", "slash")],
    *[(codex, n) for n in ("success", "tool_call", "failed_400", "retry_then_success", "server_request",
                           "context_window", "rate_limited", "foreign_thread")],
    *[(pi, n) for n in ("tool_call", "terminal_400", "retry_success", "retry_exhausted", "overflow_stale")],
    *[(bridge, n) for n in ("test_new_live_restored_history-opencode-1", "test_new_live_restored_history-kilo-1",
                            "test_autonomy_and_failures-opencode-1", "test_kilo_dead_endpoint_ends_turn-1")],
]
IDS = [f"{make.__name__}-{name}" for make, name in CASES]


async def turns(session: NativeSession, tap: Tap, emit: Any, *, most: int = 3
                ) -> list[tuple[TurnOutcome, Any, list[bytes]]]:
    """Run turns until the recording is used up: (outcome, start, lines read since the start)."""
    out = []
    with anyio.fail_after(20):
        await session.handshake()
        for i in range(most):
            mark = len(tap.lines)
            outcome = await session.run_turn(f"turn {i + 1}", emit=emit, timeout_s=5)
            if isinstance(outcome, NotSettled) and outcome.reason is NotSettledReason.TRANSPORT_CLOSED and i > 0:
                break  # the recording has no further turn
            out.append((outcome, session.last_start, tap.lines[mark:]))
            if isinstance(outcome, NotSettled):
                break
    return out


def tapped(make: Callable[[str], NativeSession], name: str) -> tuple[NativeSession, Tap]:
    session = make(name)
    tap = Tap(session.transport)
    session.transport = tap
    return session, tap


@pytest.mark.parametrize(("make", "name"), CASES, ids=IDS)
async def test_recorded_turns_replay_to_the_same_outcome(make: Callable[[str], NativeSession], name: str) -> None:
    session, tap = tapped(make, name)
    ran = await turns(session, tap, lambda _e: None)
    assert ran and any(isinstance(o, Settlement) for o, _, _ in ran), ran
    for outcome, start, lines in ran:
        restored = type(start).model_validate_json(start.model_dump_json())  # as a keeper would store it
        assert restored == start
        fresh = make(name)  # another process's session object: nothing shared but the start and lines
        assert fresh.replay_turn(lines, restored) == outcome
        if isinstance(outcome, Settlement):
            assert fresh.replay_turn(lines[:-1], restored) is None  # the evidence is the last line read


@pytest.mark.parametrize(("make", "name"), CASES, ids=IDS)
async def test_an_emit_that_raises_never_breaks_a_turn(make: Callable[[str], NativeSession], name: str) -> None:
    calm, calm_tap = tapped(make, name)
    events: list[Any] = []
    expected = await turns(calm, calm_tap, events.append)

    def explode(_event: Any) -> None:
        raise RuntimeError("a consumer's bug")

    angry, angry_tap = tapped(make, name)
    got = await turns(angry, angry_tap, explode)
    assert [o for o, _, _ in got] == [o for o, _, _ in expected]
    assert angry.locator == calm.locator and angry.turns == calm.turns


async def test_replay_without_a_start_is_refused() -> None:
    with pytest.raises(ValueError):
        codex("success").replay_turn([])

