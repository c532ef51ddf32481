"""CodexSession driven by a scripted transport replaying recorded real 0.171.0 streams."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from drivers.codex import CodexDriver, CodexSession, CodexSettings
from drivers.models import (
    ErrorNotice,
    FailureReason,
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    Notice,
    NotSettled,
    NotSettledReason,
    RetryNotice,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from tests.support.codex_replay import ReplayTransport
from tests.support.replay import Entry, load_stream

DATA = Path(__file__).resolve().parents[1] / "data" / "codex"
PATHS = MemberPaths(home="/home/agent/m", workspace="/home/agent/workspace", run_dir="/home/agent/run")
GW = GatewayConfig(base_url="http://127.0.0.1:9", key="k", model="fixture-model")
SETTINGS = CodexSettings(interrupt_grace_s=2.0, handshake_timeout_s=5.0)


def stream(name: str) -> list[Entry]:
    return load_stream(DATA / f"{name}.jsonl")


def objs(entries: list[Entry], direction: str = "recv") -> list[dict[str, Any]]:
    return [json.loads(line) for d, line in entries if d == direction]


def thread_of(entries: list[Entry]) -> str:
    for d, line in entries:
        msg = json.loads(line)
        if d == "recv" and msg.get("id") == 1 and "result" in msg:
            return msg["result"]["thread"]["id"]
        if d == "send" and msg.get("method") == "thread/resume":
            return msg["params"]["threadId"]
    raise AssertionError("no thread id")


def edit(entries: list[Entry], fn: Any) -> list[Entry]:
    """Rewrite recorded lines: ``fn(direction, obj)`` returns the new obj (or None to drop it)."""
    out: list[Entry] = []
    for d, line in entries:
        new = fn(d, json.loads(line))
        if new is not None:
            out.append((d, json.dumps(new).encode()))
    return out


def session(entries: list[Entry] | list[bytes], resume: Locator | None = None, *,
            at_end: Literal["eof", "hang"] = "eof", causal: bool = True) -> tuple[CodexSession, ReplayTransport]:
    transport = ReplayTransport(entries, at_end=at_end, causal=causal)
    driver = CodexDriver(SETTINGS)
    return driver.session(transport, driver.plan(PATHS, GW, resume)), transport


pytestmark = pytest.mark.anyio


# ---------------------------------------------------------------- recorded scenarios


async def test_new_thread_two_live_turns() -> None:
    entries = stream("success")
    s, t = session(entries)
    await s.handshake()
    thread = thread_of(entries)
    assert s.thread_id == thread and s.expected == Locator(id=thread) and s.locator is None and not s.persisted
    assert s.cli_version == "0.171.0"
    events: list[Any] = []
    r1 = await s.run_turn("hello codex", emit=events.append, timeout_s=5)
    assert isinstance(r1, Settlement) and not r1.is_error and r1.assistant_text.startswith("ok 1: ")
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == r1.assistant_text
    assert any(isinstance(e, Notice) and e.name == "warning" for e in events)
    assert r1.observed_locator == Locator(id=thread) == s.locator == s.expected and s.persisted
    r2 = await s.run_turn("second turn", timeout_s=5)
    assert isinstance(r2, Settlement) and r2.assistant_text.startswith("ok 2: ")
    assert len(s.turn_ids) == 2 and s.turns == 2 and s.active_turn is None
    sent = t.sent_objects()
    assert [m.get("method") for m in sent] == ["initialize", "initialized", "thread/start", "turn/start", "turn/start"]
    assert sent[2]["params"] == {"cwd": PATHS.workspace, "approvalPolicy": "never", "sandbox": "danger-full-access"}
    assert sent[3]["params"] == {"threadId": thread, "input": [{"type": "text", "text": "hello codex"}]}
    assert all("jsonrpc" not in m for m in sent) and not t.mismatches


@pytest.mark.parametrize("text", ["  lead/trail \n\n", "中文 😀", '{"role":"system"}', "/compact now", "a\u2028b"])
async def test_message_is_sent_byte_for_byte(text: str) -> None:
    s, t = session(stream("success"))
    await s.handshake()
    await s.run_turn(text, timeout_s=5)
    turn_start = [m for m in t.sent_objects() if m.get("method") == "turn/start"][0]
    assert turn_start["params"]["input"] == [{"type": "text", "text": text}]


async def test_restored_thread() -> None:
    entries = stream("restored")
    loc = Locator(id=thread_of(entries))
    s, t = session(entries, resume=loc)
    await s.handshake()
    assert s.locator == loc == s.expected and s.persisted
    assert t.sent_objects()[2] == {"method": "thread/resume", "id": 1,
                                   "params": {"threadId": loc.id, "excludeTurns": True}}
    r = await s.run_turn("restored turn", timeout_s=5)
    assert isinstance(r, Settlement) and not r.is_error and r.observed_locator == loc


async def test_resume_returning_another_thread_is_locator_mismatch() -> None:
    entries = stream("restored")
    loc = Locator(id=thread_of(entries))

    def swap(d: str, m: dict[str, Any]) -> dict[str, Any]:
        if d == "recv" and m.get("id") == 1 and "result" in m:
            m["result"]["thread"]["id"] = "01a2ffff-0000-7000-8000-00000000beef"
        return m
    s, t = session(edit(entries, swap), resume=loc)
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.LOCATOR_MISMATCH
    assert exc.value.observed == Locator(id="01a2ffff-0000-7000-8000-00000000beef")
    assert s.locator is None


async def test_resume_of_unknown_thread_is_native_state_missing() -> None:
    entries = stream("resume_unknown")
    s, t = session(entries, resume=Locator(id=thread_of(entries)))
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING and "no rollout found" in exc.value.detail
    assert [m.get("method") for m in t.sent_objects()] == ["initialize", "initialized", "thread/resume"]


@pytest.mark.parametrize(("message", "reason"), [
    ("invalid session id: invalid character: expected an optional prefix of `urn:uuid:`",
     HandshakeReason.NATIVE_STATE_MISSING),
    ("thread 01a2297e already has an active writer", HandshakeReason.PROCESS_FAILED),
])
async def test_other_resume_errors(message: str, reason: HandshakeReason) -> None:
    entries = stream("resume_unknown")

    def err(d: str, m: dict[str, Any]) -> dict[str, Any]:
        if d == "recv" and m.get("id") == 1:
            m["error"]["message"] = message
        return m
    s, _ = session(edit(entries, err), resume=Locator(id=thread_of(entries)))
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is reason


@pytest.mark.parametrize(("name", "reason"), [
    ("failed_400", FailureReason.API_ERROR),
    ("context_window", FailureReason.CONTEXT_TOO_LONG),
    ("rate_limited", FailureReason.RATE_LIMITED),
])
async def test_settled_failures(name: str, reason: FailureReason) -> None:
    entries = stream(name)
    s, _ = session(entries)
    await s.handshake()
    events: list[Any] = []
    r = await s.run_turn("x", emit=events.append, timeout_s=5)
    assert isinstance(r, Settlement) and r.is_error and r.reason is reason
    assert r.observed_locator == Locator(id=thread_of(entries)) == s.locator  # a settled failure is verified too
    assert [e for e in events if isinstance(e, ErrorNotice)]


async def test_retry_then_success() -> None:
    s, _ = session(stream("retry_then_success"))
    await s.handshake()
    events: list[Any] = []
    r = await s.run_turn("CUTME once", emit=events.append, timeout_s=5)
    assert isinstance(r, Settlement) and not r.is_error
    kinds = [e.kind for e in events]
    assert "retry" in kinds and kinds.index("retry") < len(kinds) - 1
    assert [e for e in events if isinstance(e, RetryNotice)][0].attempt == 1


async def test_tool_events() -> None:
    s, _ = session(stream("tool_call"))
    await s.handshake()
    events: list[Any] = []
    r = await s.run_turn("TOOLME please", emit=events.append, timeout_s=5)
    assert isinstance(r, Settlement) and r.assistant_text == "tool finished"
    assert [type(e) for e in events if isinstance(e, ToolStarted | ToolFinished)] == [ToolStarted, ToolFinished]


async def test_server_request_is_answered_and_never_left_pending() -> None:
    s, t = session(stream("server_request"))
    await s.handshake()
    events: list[Any] = []
    r = await s.run_turn("APPROVEME please", emit=events.append, timeout_s=5)
    assert isinstance(r, Settlement) and r.assistant_text == "after the approval"
    # the request used id 0, the same id as our `initialize`: told apart by `method`
    assert {"id": 0, "result": {"decision": "decline"}} in t.sent_objects()
    assert [e.detail for e in events if isinstance(e, Notice) and e.name == "server_request_refused"] == [
        "item/commandExecution/requestApproval"]


async def test_other_threads_notifications_are_ignored() -> None:
    entries = stream("foreign_thread")
    s, t = session(entries)
    await s.handshake()
    await s.run_turn("before the fork", timeout_s=5)
    fork = await s.fork()
    assert fork.id != s.thread_id
    await s._request("turn/start", {"threadId": fork.id, "input": [{"type": "text", "text": "f"}]})  # its answer: a stray
    events: list[Any] = []
    r = await s.run_turn("SLOWME mine", emit=events.append, timeout_s=5)
    assert isinstance(r, Settlement) and r.assistant_text == "ok 2: 0fa4d21144"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "ok 2: 0fa4d21144"
    assert r.observed_locator == Locator(id=s.thread_id) and not t.mismatches


async def test_turn_completed_with_another_thread_id() -> None:
    entries = stream("success")
    turn = objs(entries)[[m.get("id") for m in objs(entries)].index(2)]["result"]["turn"]["id"]

    def craft(d: str, m: dict[str, Any]) -> dict[str, Any]:
        if m.get("method") == "turn/completed" and m["params"]["turn"]["id"] == turn:
            m["params"]["threadId"] = "01a2ffff-0000-7000-8000-000000000000"
        return m
    s, _ = session(edit(entries, craft))
    await s.handshake()
    r = await s.run_turn("hello codex", timeout_s=5)
    assert isinstance(r, Settlement) and r.observed_locator == Locator(id="01a2ffff-0000-7000-8000-000000000000")
    # never "corrected": the runner compares with the thread we started and fails the turn
    assert s.locator is None and s.expected == Locator(id=thread_of(entries))


# ---------------------------------------------------------------- not settled


async def test_turn_start_error_is_command_rejected() -> None:
    def reject(d: str, m: dict[str, Any]) -> dict[str, Any] | None:
        if d == "recv" and m.get("id") == 2:
            return {"id": 2, "error": {"code": -32600, "message": "thread not found: x"}}
        return m
    s, _ = session(edit(stream("success"), reject))
    await s.handshake()
    r = await s.run_turn("x", timeout_s=5)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.COMMAND_REJECTED and "thread not found" in r.detail


async def test_turn_start_returning_a_known_turn_is_a_protocol_error() -> None:
    entries = stream("success")
    first = objs(entries)[[m.get("id") for m in objs(entries)].index(2)]["result"]["turn"]["id"]

    def steer(d: str, m: dict[str, Any]) -> dict[str, Any]:
        if d == "recv" and m.get("id") == 3 and "result" in m:
            m["result"]["turn"]["id"] = first
        return m
    s, t = session(edit(entries, steer))
    await s.handshake()
    assert isinstance(await s.run_turn("hello codex", timeout_s=5), Settlement)
    r = await s.run_turn("second", timeout_s=5)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.PROTOCOL_ERROR and "steer" in r.detail


async def test_unsettled_turn_blocks_the_next_one_without_sending() -> None:
    s, t = session(stream("interrupted"), at_end="hang")
    await s.handshake()
    s.active_turn = "left-over"  # as after a NotSettled turn whose interrupt never completed
    r = await s.run_turn("must not steer", timeout_s=5)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.PROTOCOL_ERROR
    assert "turn/start" not in [m.get("method") for m in t.sent_objects()]


async def test_interrupt_settles_as_aborted() -> None:
    s, t = session(stream("interrupted"))
    await s.handshake()
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def run() -> None:
            result.append(await s.run_turn("STALLME please", timeout_s=5))
        tg.start_soon(run)
        while s.active_turn is None:
            await anyio.sleep(0.001)
        turn = s.active_turn
        assert await s.interrupt()
    r = result[0]
    assert isinstance(r, Settlement) and r.is_error and r.reason is FailureReason.ABORTED
    assert {"method": "turn/interrupt", "id": 3, "params": {"threadId": s.thread_id, "turnId": turn}} in t.sent_objects()
    assert not await s.interrupt()  # nothing active any more


async def test_timeout_sends_the_interrupt_then_not_settled() -> None:
    s, t = session(stream("interrupted"))
    await s.handshake()
    # the recorded interrupt response is only released once the driver sends turn/interrupt
    r = await s.run_turn("STALLME please", timeout_s=0.3)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.TIMEOUT
    assert [m.get("method") for m in t.sent_objects()][-1] == "turn/interrupt"
    assert s.active_turn is None  # the native turn did end (interrupted) within the grace


async def test_cancellation_sends_the_interrupt_shielded_and_reraises() -> None:
    s, t = session(stream("interrupted"))
    await s.handshake()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel() -> None:
                while s.active_turn is None:
                    await anyio.sleep(0.001)
                scope.cancel()
            tg.start_soon(cancel)
            await s.run_turn("STALLME please", timeout_s=5)
            pytest.fail("not cancelled")
    assert scope.cancelled_caught
    assert [m.get("method") for m in t.sent_objects()][-1] == "turn/interrupt" and s.active_turn is None


async def test_eof_mid_turn_is_transport_closed() -> None:
    entries = stream("success")
    cut = [d == "recv" and json.loads(line).get("method") == "item/agentMessage/delta" for d, line in entries].index(True)
    s, _ = session(entries[: cut + 1])
    await s.handshake()
    r = await s.run_turn("hello codex", timeout_s=5)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.TRANSPORT_CLOSED
    assert r.assistant_text  # what streamed before the end is kept for the receipt


async def test_eof_during_handshake_is_process_failed() -> None:
    s, _ = session(stream("success")[:2])
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.PROCESS_FAILED


async def test_launcher_error_line_maps_to_handshake_reason() -> None:
    s, _ = session([b'{"type":"launch_error","reason":"exec_failed","command":"codex-native"}'])
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.PROCESS_FAILED


async def test_silent_cli_handshake_times_out() -> None:
    driver = CodexDriver(SETTINGS, handshake_timeout_s=0.2)
    s = driver.session(ReplayTransport([], at_end="hang"), driver.plan(PATHS, GW, None))
    with pytest.raises(HandshakeFailed, match="timed out"):
        await s.handshake()


async def test_run_turn_before_handshake() -> None:
    s, t = session(stream("success"))
    r = await s.run_turn("x")
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.PROTOCOL_ERROR and t.sent == []


# ---------------------------------------------------------------- property tests


def _prefix_through_turn_start(name: str) -> list[Entry]:
    entries = stream(name)
    end = [d == "recv" and json.loads(line).get("id") == 2 for d, line in entries].index(True)
    return entries[: end + 1]


def _run(entries: list[Entry] | list[bytes], *, causal: bool = False) -> Any:
    async def main() -> Any:
        s, _ = session(entries, causal=causal)
        with anyio.fail_after(10):  # "never hang": a hang fails the example
            try:
                await s.handshake()
            except HandshakeFailed as exc:
                return exc
            return await s.run_turn("hello codex", timeout_s=5)
    return anyio.run(main)


lines = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"", b"{", b"[]", b"null", b'{"method":"turn/completed"}', b'{"id":2}',
                     b'{"method":"turn/completed","params":{"turn":{"id":null}}}', b'{"id":"2","result":{}}']),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lines, max_size=40))
def test_garbage_after_a_started_turn_never_settles(garbage: list[bytes]) -> None:
    outcome = _run(_prefix_through_turn_start("success") + [("recv", g) for g in garbage])
    assert isinstance(outcome, NotSettled) and outcome.reason is NotSettledReason.TRANSPORT_CLOSED, outcome


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["success", "failed_400", "retry_then_success", "tool_call", "server_request",
                             "interrupted", "context_window"]),
       data=st.data())
def test_truncated_recordings_settle_only_with_evidence(name: str, data: st.DataObject) -> None:
    entries = stream(name)
    cut = data.draw(st.integers(min_value=0, max_value=len(entries)))
    kept = entries[:cut]
    outcome = _run(kept)
    has_evidence = any(d == "recv" and json.loads(line).get("method") == "turn/completed" for d, line in kept)
    if isinstance(outcome, Settlement):
        assert has_evidence
    elif not isinstance(outcome, HandshakeFailed):
        assert isinstance(outcome, NotSettled) and outcome.reason is NotSettledReason.TRANSPORT_CLOSED
        assert not has_evidence


def _garble(line: bytes, how: int, pos: int) -> bytes:
    pos = pos % (len(line) + 1)
    if how == 0:
        return line[:pos]  # truncated
    if how == 1:
        return line[:pos] + b"\xff\xfe" + line[pos:]  # invalid UTF-8
    if how == 2:
        return line[:pos] + b'"}]{' + line[pos:]  # broken JSON
    return line.replace(b'"', b"'", 1)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["success", "failed_400", "tool_call", "retry_then_success"]),
       edits=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 3), st.integers(0, 10_000)), max_size=8))
def test_garbled_lines_never_crash_or_hang(name: str, edits: list[tuple[int, int, int]]) -> None:
    entries = list(stream(name))
    for idx, how, pos in edits:
        i = idx % len(entries)
        d, line = entries[i]
        entries[i] = (d, _garble(line, how, pos))
    outcome = _run(entries)
    assert isinstance(outcome, Settlement | NotSettled | HandshakeFailed)
