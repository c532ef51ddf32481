"""Property tests: random, truncated or garbled pi streams never crash or hang the driver."""

from __future__ import annotations

import json
from typing import Any

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drivers.models import Locator, NotSettled, NotSettledReason, Settlement
from drivers.pi import PiSession, PiSettings
from drivers.pi.wire import PiTurn
from tests.support.pi_replay import DEFAULT_STATE, ScriptedPiTransport
from tests.unit.test_pi_support import RECORDINGS, launch_for, recording

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
AUTO_LOC = Locator(id=DEFAULT_STATE["sessionId"], path=DEFAULT_STATE["sessionFile"])

EVENT_TYPES = ["response", "agent_start", "agent_end", "turn_start", "turn_end", "message_start", "message_update",
               "message_end", "tool_execution_start", "tool_execution_end", "auto_retry_start", "auto_retry_end",
               "compaction_start", "compaction_end", "queue_update", 7, None]
junk = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
pi_like = st.fixed_dictionaries(
    {"type": st.sampled_from(EVENT_TYPES)},
    optional={"id": st.sampled_from(["p1", "b2", "x", 3, None]), "success": junk, "data": junk,
              "message": junk | st.fixed_dictionaries({"role": st.sampled_from(["assistant", "user", 1]),
                                                       "stopReason": junk, "content": junk, "errorMessage": junk}),
              "messages": junk, "assistantMessageEvent": junk, "willRetry": junk, "attempt": junk,
              "toolCallId": junk, "result": junk, "error": junk, "command": junk},
)
line = st.one_of(st.binary(max_size=40), pi_like.map(lambda o: json.dumps(o).encode()),
                 st.text(max_size=30).map(str.encode))


def run(coro_fn: Any, timeout: float = 5.0) -> Any:
    async def main() -> Any:
        with anyio.fail_after(timeout):  # "never hangs"
            return await coro_fn()

    return anyio.run(main)


def auto_session(lines: list[bytes]) -> PiSession:
    transport = ScriptedPiTransport(lines, auto_state=dict(DEFAULT_STATE))
    return PiSession(transport, launch_for(AUTO_LOC), PiSettings(handshake_timeout_s=2, abort_grace_s=0.5))


@SETTINGS
@given(st.lists(line, max_size=40))
def test_random_lines_never_crash_and_end_not_settled(lines: list[bytes]) -> None:
    lines = [raw for raw in lines if b"agent_end" not in raw]  # no evidence in the stream

    async def go() -> object:
        session = auto_session(lines)
        await session.handshake()
        return await session.run_turn("hello", timeout_s=3)

    out = run(go)
    assert isinstance(out, NotSettled)
    assert out.reason in (NotSettledReason.TRANSPORT_CLOSED, NotSettledReason.COMMAND_REJECTED)


@SETTINGS
@given(st.lists(pi_like, max_size=60))
def test_tracker_never_raises(objs: list[dict[str, Any]]) -> None:
    turn = PiTurn(prompt_id="p1")
    for i, obj in enumerate(objs):
        step = turn.feed(obj)
        if step.send_barrier:
            turn.barrier_sent(f"b{i}")
        assert step.settlement is None or isinstance(step.settlement, Settlement)


def _full_run(name: str) -> tuple[object, int]:
    """The first turn of a recording: its outcome and how many lines it took to settle."""
    entries = recording(name)

    async def go() -> tuple[object, int]:
        transport = ScriptedPiTransport(entries)
        from tests.unit.test_pi_support import recorded_locator

        session = PiSession(transport, launch_for(recorded_locator(entries)), PiSettings(abort_grace_s=0.5))
        await session.handshake()
        prompt = next(json.loads(raw)["message"] if "message" in json.loads(raw) else "x"
                      for d, raw in entries if d == "in" and json.loads(raw)["type"] == "prompt")
        out = await session.run_turn(prompt, timeout_s=3)
        return out, sum(1 for d, _ in entries[: transport._pos] if d == "out")

    return run(go)


FULL = {name: _full_run(name) for name in RECORDINGS if name not in ("abort",)}  # abort needs an interrupt


@SETTINGS
@given(st.sampled_from(sorted(FULL)), st.integers(min_value=0, max_value=200))
def test_truncated_recordings_are_not_settled_until_the_evidence(name: str, cut: int) -> None:
    entries = recording(name)
    outs = [i for i, (d, _) in enumerate(entries) if d == "out"]
    full, needed = FULL[name]
    cut = min(cut, len(outs))
    kept = entries[: outs[cut - 1] + 1] if cut else [e for e in entries[:1] if e[0] == "in"]

    async def go() -> object:
        from tests.unit.test_pi_support import recorded_locator

        session = PiSession(ScriptedPiTransport(kept), launch_for(recorded_locator(entries)),
                            PiSettings(handshake_timeout_s=2, abort_grace_s=0.5))
        try:
            await session.handshake()
        except Exception as exc:  # noqa: BLE001 - a cut before the handshake answer
            return exc
        prompt = next(json.loads(raw)["message"] if "message" in json.loads(raw) else "x"
                      for d, raw in entries if d == "in" and json.loads(raw)["type"] == "prompt")
        return await session.run_turn(prompt, timeout_s=3)

    out = run(go)
    if cut < 1:
        assert type(out).__name__ == "HandshakeFailed"
    elif cut < needed:
        assert isinstance(out, NotSettled) and out.reason == NotSettledReason.TRANSPORT_CLOSED, (cut, needed, out)
    else:
        assert out == full


@SETTINGS
@given(st.sampled_from(RECORDINGS), st.data())
def test_garbled_recordings_never_crash_or_hang(name: str, data: st.DataObject) -> None:
    outs = [raw for d, raw in recording(name) if d == "out"]
    garbled = []
    for raw in outs:
        action = data.draw(st.sampled_from(["keep"] * 6 + ["drop", "cut", "flip", "dup", "junk"]))
        if action == "keep":
            garbled.append(raw)
        elif action == "cut":
            garbled.append(raw[: data.draw(st.integers(0, max(0, len(raw) - 1)))])
        elif action == "flip" and raw:
            i = data.draw(st.integers(0, len(raw) - 1))
            garbled.append(raw[:i] + bytes([raw[i] ^ 0x5A]) + raw[i + 1:])
        elif action == "dup":
            garbled += [raw, raw]
        elif action == "junk":
            garbled += [data.draw(line), raw]

    async def go() -> object:
        session = auto_session(garbled)
        await session.handshake()
        return await session.run_turn("x", timeout_s=3)

    out = run(go)
    assert isinstance(out, (Settlement, NotSettled))
