"""Property tests: random, truncated and garbled Claude streams never crash or hang the
parser, and a stream that ends without settlement evidence is NotSettled(transport_closed)."""

from __future__ import annotations

import json
from typing import Any

import anyio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drivers.claude.wire import TurnTracker, failure_reason, normalize, sanitize_project_dir
from drivers.models import NotSettled, NotSettledReason, Settlement
from tests.unit.test_claude_replay import SETTINGS, load_stream, make_session

NAMES = ["success", "live", "failure_400", "context_400", "retry", "tool", "child_agent", "background_origin",
         "interrupt", "restored", "slash"]
RECORDED: dict[str, list[bytes]] = {
    name: [json.dumps(o, ensure_ascii=False).encode() for d, o in load_stream(name)[1] if d == "recv"]
    for name in NAMES
}
SID = load_stream("success")[0]["expected"]

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
json_values = st.recursive(json_scalars, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
protocolish = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from(["system", "assistant", "user", "result", "control_request", "control_response",
                                 "stream_event", "launch_error", "weird"]) | json_values,
        "subtype": st.sampled_from(["init", "api_retry", "session_state_changed", "task_started",
                                    "task_notification", "background_tasks_changed", "success",
                                    "error_during_execution", "status"]) | json_values,
        "state": st.sampled_from(["idle", "running", "requires_action"]) | json_values,
        "session_id": st.sampled_from([SID, "other", ""]) | json_values,
        "parent_tool_use_id": st.none() | st.text(max_size=5) | json_values,
        "is_error": json_values,
        "origin": json_values,
        "task_id": json_values,
        "tasks": json_values,
        "result": json_values,
        "terminal_reason": json_values,
        "api_error_status": json_values,
        "errors": json_values,
        "message": st.fixed_dictionaries({}, optional={"content": json_values | st.lists(
            st.fixed_dictionaries({}, optional={"type": st.sampled_from(["text", "tool_use", "tool_result"]),
                                                "text": json_values, "id": json_values, "name": json_values,
                                                "input": json_values, "content": json_values,
                                                "tool_use_id": json_values, "is_error": json_values}),
            max_size=3)}) | json_values,
    },
)


@settings(max_examples=400, deadline=None)
@given(st.lists(protocolish, max_size=30), st.sampled_from([None, SID]), st.booleans())
def test_tracker_and_normalizer_never_raise(objs: list[dict[str, Any]], expected: str | None, state: bool) -> None:
    t = TurnTracker(expected, state_events=state)
    for obj in objs:
        t.feed(obj)
        normalize(obj)
        if obj.get("type") == "result":
            failure_reason(obj)
        if t.settled:
            t.settlement()  # must build for any shape
    t.observed_locator()
    t.assistant_text()


def _run(lines: list[bytes]) -> Any:
    steps = [("recv", line) for line in lines]

    async def main() -> Any:
        s, _ = make_session(steps, SID, settings=SETTINGS)
        with anyio.fail_after(5):  # a hang fails the property
            return await s.run_turn("hi", timeout_s=3)

    return anyio.run(main)


garbage = st.binary(max_size=60) | st.text(max_size=60).map(lambda s: s.encode("utf-8", "surrogatepass"))


@st.composite
def garbled_stream(draw: st.DrawFn) -> list[bytes]:
    lines = list(RECORDED[draw(st.sampled_from(NAMES))])
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["truncate", "insert", "drop", "cut_stream", "flip"]))
        if not lines:
            break
        i = draw(st.integers(0, len(lines) - 1))
        if op == "truncate":
            lines[i] = lines[i][: draw(st.integers(0, len(lines[i])))]
        elif op == "insert":
            lines.insert(i, draw(garbage))
        elif op == "drop":
            del lines[i]
        elif op == "cut_stream":
            lines = lines[:i]
        elif op == "flip":
            b = bytearray(lines[i])
            if b:
                j = draw(st.integers(0, len(b) - 1))
                b[j] = draw(st.integers(0, 255))
            lines[i] = bytes(b)
    return lines


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(garbled_stream())
def test_garbled_recorded_streams_never_crash_or_hang(lines: list[bytes]) -> None:
    out = _run(lines)
    assert isinstance(out, Settlement | NotSettled)
    if isinstance(out, NotSettled):
        assert out.reason in (NotSettledReason.TRANSPORT_CLOSED, NotSettledReason.TIMEOUT)


def _is_evidence(line: bytes) -> bool:
    try:
        obj = json.loads(line)
    except ValueError:
        return False
    return isinstance(obj, dict) and obj.get("type") == "result"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(NAMES), st.lists(garbage, max_size=5), st.data())
def test_stream_ending_without_evidence_is_transport_closed(name: str, junk: list[bytes], data: st.DataObject) -> None:
    lines = [line for line in RECORDED[name] if not _is_evidence(line)]
    for item in junk:
        lines.insert(data.draw(st.integers(0, len(lines))), item)
    out = _run(lines)
    assert isinstance(out, NotSettled) and out.reason is NotSettledReason.TRANSPORT_CLOSED


@settings(max_examples=60, deadline=None)
@given(st.lists(garbage, max_size=20))
def test_pure_garbage_is_transport_closed(lines: list[bytes]) -> None:
    lines = [line for line in lines if not _is_evidence(line)]
    out = _run(lines)
    assert isinstance(out, NotSettled) and out.reason is NotSettledReason.TRANSPORT_CLOSED


@given(st.text(max_size=400))
def test_sanitized_project_dir_is_path_safe(cwd: str) -> None:
    name = sanitize_project_dir(cwd)
    assert all(c.isascii() and (c.isalnum() or c == "-") for c in name)
    assert len(name) <= 200 + 1 + 7
