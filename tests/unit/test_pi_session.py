"""PiSession over recorded real pi 0.73.1 streams (tests/data/pi/, see capture.py there).

The scripted transport replays pi's lines and blocks at each recorded command until the
driver really sends it, so barrier ordering is checked by construction.
"""

from __future__ import annotations

import json

import anyio
import pytest

from drivers.models import (
    ErrorNotice,
    FailureReason,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    NotSettled,
    NotSettledReason,
    RetryNotice,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from tests.unit.test_pi_support import Sink, recorded_locator, recording, replay_session

pytestmark = pytest.mark.anyio


def settled(outcome: object) -> Settlement:
    assert isinstance(outcome, Settlement), outcome
    return outcome


def obj_types(lines: list[bytes]) -> list[str]:
    return [json.loads(line).get("type", "?") for line in lines]


async def test_tool_call_two_turns_one_settlement() -> None:
    entries = recording("tool_call")
    session, t = replay_session(entries)
    await session.handshake()
    assert session.locator is None and session.reported == recorded_locator(entries)
    sink = Sink()
    out = settled(await session.run_turn("please TOOL now", emit=sink))
    assert not out.is_error and out.reason is None
    assert out.assistant_text == "tool done" and sink.text() == "tool done"
    started = [e for e in sink.events if isinstance(e, ToolStarted)]
    finished = [e for e in sink.events if isinstance(e, ToolFinished)]
    assert [(e.tool, e.input) for e in started] == [("bash", {"command": "echo hi-from-tool"})]
    assert [(e.call_id, e.is_error, e.output) for e in finished] == [(started[0].call_id, False, "hi-from-tool\n")]
    # exactly one barrier, sent only after the single agent_end (two turn_end came before it)
    barriers = [i for i, c in enumerate(t.sent) if c["type"] == "get_state"][1:]
    assert len(barriers) == 1
    seen = obj_types(t.delivered[: t.sent_after[barriers[0]]])
    assert seen[-1] == "agent_end" and seen.count("turn_end") == 2
    assert out.observed_locator == session.reported == session.locator
    assert session.persisted and t.commands("prompt")[0]["message"] == "please TOOL now"


async def test_terminal_400_is_a_settled_failure_then_follow_up_succeeds() -> None:
    session, _ = replay_session(recording("terminal_400"))
    await session.handshake()
    sink = Sink()
    first = settled(await session.run_turn("please FAIL400 now", emit=sink))
    assert first.is_error and first.reason == FailureReason.API_ERROR
    assert first.detail and first.detail.startswith("400 ") and "request rejected (terminal)" in first.detail
    assert first.assistant_text == ""  # never an "empty success"
    assert [e.will_retry for e in sink.events if isinstance(e, ErrorNotice)] == [False]
    assert session.persisted  # the 400's message_end flushed the session file
    second = settled(await session.run_turn("after the error"))
    assert not second.is_error and second.assistant_text.startswith("ok 2: ")
    assert second.observed_locator == first.observed_locator == session.locator


async def test_auto_retry_then_success_waits_past_the_first_agent_end() -> None:
    session, t = replay_session(recording("retry_success"))
    await session.handshake()
    sink = Sink()
    out = settled(await session.run_turn("FLAKY one", emit=sink))
    assert not out.is_error and out.assistant_text.startswith("ok 1: ")
    retries = [e for e in sink.events if isinstance(e, RetryNotice)]
    assert [(r.attempt, r.status) for r in retries] == [(1, 500)]
    assert [e.will_retry for e in sink.events if isinstance(e, ErrorNotice)] == [True]
    # two barriers: the first was answered after auto_retry_start and did not settle the turn
    barriers = [i for i, c in enumerate(t.sent) if c["type"] == "get_state"][1:]
    assert len(barriers) == 2
    first_answer = next(i for i, line in enumerate(t.delivered)
                        if json.loads(line).get("id") == t.sent[barriers[0]]["id"])
    assert obj_types(t.delivered[:first_answer])[-1] == "auto_retry_start"


async def test_retries_exhausted_is_a_settled_failure() -> None:
    session, _ = replay_session(recording("retry_exhausted"))
    await session.handshake()
    sink = Sink()
    out = settled(await session.run_turn("ALWAYS503 please", emit=sink))
    assert out.is_error and out.reason == FailureReason.OVERLOADED and out.detail.startswith("503 ")
    assert [e.attempt for e in sink.events if isinstance(e, RetryNotice)] == [1]
    assert "retry_end" in [getattr(e, "name", None) for e in sink.events]


async def _interrupt_when_assistant_starts(session, t) -> None:
    while not any(json.loads(line).get("type") == "message_start"
                  and json.loads(line).get("message", {}).get("role") == "assistant" for line in t.delivered):
        await anyio.sleep(0.005)
    assert await session.interrupt()


async def test_abort_settles_as_aborted_and_the_session_goes_on() -> None:
    session, t = replay_session(recording("abort"))
    await session.handshake()
    result: list[object] = []
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            async def run() -> None:
                result.append(await session.run_turn("STALL please"))

            tg.start_soon(run)
            await _interrupt_when_assistant_starts(session, t)
    out = settled(result[0])
    assert out.is_error and out.reason == FailureReason.ABORTED
    assert len(t.commands("abort")) == 1
    # the abort's late response (after agent_end) is not mistaken for anything
    assert not settled(await session.run_turn("after abort")).is_error
    assert not await session.interrupt()  # no turn running


async def test_context_overflow_then_stale_compaction_event_is_ignored() -> None:
    session, t = replay_session(recording("overflow_stale"))
    await session.handshake()
    sink = Sink()
    first = settled(await session.run_turn("HUGE one", emit=sink))
    assert first.is_error and first.reason == FailureReason.CONTEXT_TOO_LONG
    assert "compaction" in [getattr(e, "name", None) for e in sink.events]
    second = settled(await session.run_turn("after huge"))
    assert not second.is_error and second.assistant_text.startswith("ok 3: ")
    # the recorded stale compaction_end really came between our prompt and its response
    prompt_sent = t.sent_after[[c["type"] for c in t.sent].index("prompt", 2)]
    assert obj_types(t.delivered[prompt_sent:prompt_sent + 2]) == ["compaction_end", "response"]


async def test_stale_compaction_start_before_agent_start_cannot_block_settlement() -> None:
    entries = recording("tool_call")
    idx = next(i for i, (d, line) in enumerate(entries) if d == "in" and json.loads(line)["type"] == "prompt")
    # a compaction_start whose end never comes (it belonged to an earlier run): if it counted,
    # the turn would wait for "compaction_end" forever
    stale = [("out", b'{"type":"compaction_start","reason":"overflow"}')]
    session, _ = replay_session(entries[: idx + 1] + stale + entries[idx + 1:])
    await session.handshake()
    with anyio.fail_after(5):
        assert not settled(await session.run_turn("please TOOL now")).is_error


async def test_key_missing_fails_closed_without_a_session_file() -> None:
    session, _ = replay_session(recording("key_missing"))
    await session.handshake()
    out = settled(await session.run_turn("hello without a key"))
    assert out.is_error and out.reason == FailureReason.AUTH and "printenv" in (out.detail or "")
    assert not session.persisted  # no assistant message_end: pi never wrote the file


async def test_prompt_rejected_is_not_settled() -> None:
    loc = Locator(id="01a2-x", path="/s/x.jsonl")
    entries = [("in", b'{"id":"s","type":"get_state"}'),
               ("out", json.dumps({"id": "s", "type": "response", "command": "get_state", "success": True,
                                   "data": {"sessionId": loc.id, "sessionFile": loc.path, "messageCount": 0,
                                            "isStreaming": False, "isCompacting": False}}).encode()),
               ("in", b'{"id":"P","type":"prompt"}'),
               ("out", b'{"id":"P","type":"response","command":"prompt","success":false,'
                       b'"error":"Agent is already processing."}')]
    session, _ = replay_session(entries, new_locator=loc, hold_open=True)
    await session.handshake()
    sink = Sink()
    with anyio.fail_after(5):
        out = await session.run_turn("x", emit=sink)
    assert isinstance(out, NotSettled) and out.reason == NotSettledReason.COMMAND_REJECTED
    assert "already processing" in out.detail and sink.events == []


@pytest.mark.parametrize("cut_after", ["message_update", "agent_end"])
async def test_stream_ending_before_settlement_is_transport_closed(cut_after: str) -> None:
    entries = recording("tool_call")
    last = max(i for i, (d, line) in enumerate(entries) if d == "out" and json.loads(line).get("type") == cut_after)
    session, _ = replay_session(entries[: last + 1])
    await session.handshake()
    with anyio.fail_after(5):
        out = await session.run_turn("please TOOL now")
    assert isinstance(out, NotSettled) and out.reason == NotSettledReason.TRANSPORT_CLOSED


async def test_garbled_lines_in_between_change_nothing() -> None:
    entries = recording("terminal_400")
    noisy = []
    for e in entries:
        noisy.append(e)
        if e[0] == "out":
            noisy += [("out", b"not json"), ("out", b'{"type":'), ("out", b"[1,2]"), ("out", b"\xff\xfe"),
                      ("out", b'{"type":7}')]
    session, _ = replay_session(noisy)
    await session.handshake()
    assert settled(await session.run_turn("please FAIL400 now")).reason == FailureReason.API_ERROR


async def test_timeout_sends_abort_then_not_settled() -> None:
    entries = recording("tool_call")
    cut = next(i for i, (d, line) in enumerate(entries) if d == "out" and json.loads(line).get("type") == "turn_start")
    session, t = replay_session(entries[: cut + 1], hold_open=True)
    await session.handshake()
    with anyio.fail_after(5):
        out = await session.run_turn("please TOOL now", timeout_s=0.2)
    assert isinstance(out, NotSettled) and out.reason == NotSettledReason.TIMEOUT
    assert len(t.commands("abort")) == 1


async def test_cancellation_sends_abort_shielded_and_reraises() -> None:
    entries = recording("tool_call")
    cut = next(i for i, (d, line) in enumerate(entries) if d == "out" and json.loads(line).get("type") == "turn_start")
    session, t = replay_session(entries[: cut + 1], hold_open=True)
    await session.handshake()
    reached = False
    with anyio.move_on_after(0.2):
        await session.run_turn("please TOOL now")
        reached = True
    assert not reached and len(t.commands("abort")) == 1 and session.turn is None


async def test_changed_session_id_at_settlement_is_reported_not_adopted() -> None:
    entries = recording("tool_call")
    last_state = max(i for i, (d, line) in enumerate(entries) if d == "out" and b'"get_state"' in line)
    obj = json.loads(entries[last_state][1])
    obj["data"]["sessionId"] = "01a2-other"
    entries[last_state] = ("out", json.dumps(obj).encode())
    session, _ = replay_session(entries)
    await session.handshake()
    out = settled(await session.run_turn("please TOOL now"))
    assert out.observed_locator is not None and out.observed_locator.id == "01a2-other"
    assert session.locator is None  # left for the runner to reject


# ------------------------------------------------------------------ handshake


def _state(entries, **changes) -> list:
    out = list(entries)
    i = next(i for i, (d, line) in enumerate(out) if d == "out" and b'"get_state"' in line)
    obj = json.loads(out[i][1])
    obj["data"].update(changes)
    out[i] = ("out", json.dumps(obj).encode())
    return out


async def test_restored_handshake_accepts_the_saved_locator() -> None:
    entries = _state(recording("tool_call"), messageCount=4)
    loc = recorded_locator(entries)
    session, _ = replay_session(entries, resume_locator=loc)
    await session.handshake()
    assert session.locator == loc and session.persisted


@pytest.mark.parametrize("changes", [{"messageCount": 0}, {"sessionId": "01a2-new", "messageCount": 3},
                                     {"sessionFile": "/elsewhere.jsonl", "messageCount": 3}, {"sessionId": None}])
async def test_restored_handshake_mismatch(changes) -> None:
    base = recording("tool_call")
    session, t = replay_session(_state(base, **changes), resume_locator=recorded_locator(base))
    with pytest.raises(HandshakeFailed) as err:
        await session.handshake()
    assert err.value.reason == HandshakeReason.LOCATOR_MISMATCH
    assert t.commands("prompt") == []


async def test_new_handshake_rejects_another_path_or_an_existing_conversation() -> None:
    base = recording("tool_call")
    for changes in ({"sessionFile": "/other.jsonl"}, {"messageCount": 2}):
        session, _ = replay_session(_state(base, **changes), new_locator=recorded_locator(base))
        with pytest.raises(HandshakeFailed) as err:
            await session.handshake()
        assert err.value.reason == HandshakeReason.LOCATOR_MISMATCH


@pytest.mark.parametrize(("payload", "reason"), [
    ({"type": "launch_error", "reason": "missing_file", "path": "/s/x.jsonl"}, HandshakeReason.NATIVE_STATE_MISSING),
    ({"type": "launch_error", "reason": "header_mismatch", "path": "/s/x.jsonl", "key": "id", "expected": "a",
      "observed": "b"}, HandshakeReason.LOCATOR_MISMATCH),
])
async def test_launch_errors(payload, reason) -> None:
    loc = Locator(id="a", path="/s/x.jsonl")
    session, _ = replay_session([json.dumps(payload).encode()], resume_locator=loc)
    with pytest.raises(HandshakeFailed) as err:
        await session.handshake()
    assert err.value.reason == reason


async def test_process_exit_before_get_state_is_process_failed() -> None:
    session, _ = replay_session([], resume_locator=Locator(id="a", path="/s/x.jsonl"))
    with pytest.raises(HandshakeFailed) as err:
        await session.handshake()
    assert err.value.reason == HandshakeReason.PROCESS_FAILED


# ------------------------------------------------------------------ fork


async def test_fork_at_a_historical_turn_switches_to_the_new_session() -> None:
    entries = recording("fork")
    session, t = replay_session(entries)
    await session.handshake()
    source = None
    for msg in ("u1", "u2"):
        source = settled(await session.run_turn(msg)).observed_locator
    new = await session.fork(1)
    assert new != source and new.id != source.id and new.path != source.path
    assert session.locator == session.expected == new
    fork_cmd = t.commands("fork")[0]
    listed = next(json.loads(line) for d, line in entries if d == "out" and b'"get_fork_messages"' in line)
    assert fork_cmd["entryId"] == listed["data"]["messages"][1]["entryId"]  # before u2
    after = settled(await session.run_turn("on the fork"))
    assert after.observed_locator == new and after.assistant_text.startswith("ok 2: ")


async def test_fork_needs_a_persisted_turn() -> None:
    from drivers.pi.session import ForkFailed

    session, _ = replay_session(recording("tool_call"))
    await session.handshake()
    with pytest.raises(ForkFailed):
        await session.fork(1)


async def test_text_deltas_are_the_delta_field_not_snapshots() -> None:
    session, _ = replay_session(recording("terminal_400"))
    await session.handshake()
    await session.run_turn("please FAIL400 now")
    sink = Sink()
    out = settled(await session.run_turn("after the error", emit=sink))
    deltas = [e.text for e in sink.events if isinstance(e, TextDelta)]
    assert len(deltas) > 1 and "".join(deltas) == out.assistant_text


async def test_message_is_sent_as_is_even_with_a_lone_surrogate() -> None:
    entries = recording("terminal_400")
    session, t = replay_session(entries)
    await session.handshake()
    weird = "para\n\n  中文 🚀\u2028 \ud800 {\"json\": 1} /help  "
    await session.run_turn(weird)
    assert t.commands("prompt")[0]["message"] == weird
