"""The Codex driver against the real pinned codex 0.171.0 inside the pinned image.

Every test drives ``codex-native app-server`` in a container (sealed: network none, the model through its socket and a proxy in front of the in-process loopback fixture) through ``ca-launch``, with member
paths bind-mounted at the same absolute path. What the model saw is asserted on the
fixture's recorded requests.

``CODEX_CAPTURE=1`` additionally runs :func:`test_capture_streams`, which rewrites the
recorded wire streams under tests/data/codex/ used by the unit tests.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.cli.driver_harness import DriverBox, box_fixtures, ok

from deploy.loopback import LoopbackFixture, Message, cut, default_reply, fail, reject, shell_call, stall
from deploy.loopback.behaviour import TERMINAL_MESSAGE
from drivers.codex import CodexDriver, CodexSession, CodexSettings
from drivers.codex.launch import render_config
from drivers.models import (
    FailureReason,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    NotSettled,
    NotSettledReason,
    RetryNotice,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from tests.support.recording_shape import codex_stream_kinds, compare
from tests.support.replay import Entry, dump_stream, load_stream

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

KEY = "sk-codex-fixture-canary-5b7e0d"
MODEL = "fixture-model"
DATA = Path(__file__).resolve().parents[1] / "data" / "codex"
SETTINGS = CodexSettings(request_max_retries=1, stream_max_retries=1, stream_idle_timeout_ms=8000,
                         interrupt_grace_s=5.0, handshake_timeout_s=60.0)


# ---------------------------------------------------------------- harness


class Box(DriverBox):
    key = KEY
    api = "responses"

    def __init__(self, container: Any, root: Path, fx: LoopbackFixture, name: str) -> None:
        super().__init__(container, root, fx, name)
        self.driver = CodexDriver(SETTINGS)

    async def start(self, paths: MemberPaths, resume: Locator | None = None, *,
                    log: list[Entry] | None = None, launch: Any = None) -> CodexSession:
        launch = launch or self.driver.plan(paths, self.gateway, resume)
        transport = await self.launch(launch.spec, paths, log, setup_workspace=self._git_init)
        return self.driver.session(transport, launch)

    def _git_init(self, ws: Path) -> None:
        if not (ws / ".git").exists():
            self.exec("git", "init", "-q", str(ws))  # a repo: the case where Codex writes trust entries


root, container, box = box_fixtures("codex", Box)


# ---------------------------------------------------------------- NEW / LIVE / RESTORED


async def test_new_live_restored_history(box: Box) -> None:
    paths = box.member("m")
    s = await box.start(paths)
    await s.handshake()
    # the thread the handshake started is what every turn must report (not on disk before a turn)
    assert s.thread_id and s.expected == Locator(id=s.thread_id) and s.locator is None
    assert s.cli_version == "0.171.0"
    events: list[Any] = []
    u1, u2, u3 = "first question alpha", "second question beta", "third question gamma"
    r1 = ok(await s.run_turn(u1, emit=events.append, timeout_s=60))
    a1 = default_reply([u1])
    assert r1.assistant_text == a1
    assert r1.observed_locator == Locator(id=s.thread_id) == s.locator
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == a1
    assert box.dialogue() == [Message.user(u1)]
    req = box.fx.last()
    assert req.headers.get("thread-id") == s.thread_id and req.body["model"] == MODEL

    r2 = ok(await s.run_turn(u2, timeout_s=60))  # LIVE
    a2 = default_reply([u1, u2])
    assert r2.assistant_text == a2
    assert box.dialogue() == [Message.user(u1), Message.assistant(a1), Message.user(u2)]

    await box.kill(s)
    s2 = await box.start(paths, resume=r2.observed_locator)  # RESTORED
    await s2.handshake()
    assert s2.locator == r2.observed_locator
    r3 = ok(await s2.run_turn(u3, timeout_s=60))
    assert r3.observed_locator == r2.observed_locator
    assert box.dialogue() == [Message.user(u1), Message.assistant(a1), Message.user(u2), Message.assistant(a2),
                              Message.user(u3)]
    # Codex wrote nothing into the driver-owned config.toml (the trust entry was pre-answered)
    config = Path(box.driver.codex_home(paths)) / "config.toml"
    assert config.read_text() == render_config(paths, box.gateway, SETTINGS)
    assert KEY not in config.read_text()
    assert len(box.fx.conversation_requests()) == 3
    assert not [r for r in box.fx.requests() if r.kind != "conversation"]  # no side requests


async def test_zero_turn_thread_is_not_resumable(box: Box) -> None:
    paths = box.member("m")
    s = await box.start(paths)
    await s.handshake()
    thread = s.thread_id
    await box.kill(s)
    s2 = await box.start(paths, resume=Locator(id=thread))
    with pytest.raises(HandshakeFailed) as exc:
        await s2.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING
    assert box.fx.requests() == []


@pytest.mark.parametrize("thread_id", ["01a2297e-8a4e-7000-8000-000000000000", "not-a-thread-id"])
async def test_resume_unknown_thread_is_refused_without_model_requests(box: Box, thread_id: str) -> None:
    s = await box.start(box.member("m"), resume=Locator(id=thread_id))
    with pytest.raises(HandshakeFailed) as exc:
        await s.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING, exc.value
    assert box.fx.requests() == []


async def test_second_writer_is_process_failed(box: Box) -> None:
    paths = box.member("m")
    s = await box.start(paths)
    await s.handshake()
    r = ok(await s.run_turn("hold the writer", timeout_s=60))
    s2 = await box.start(paths, resume=r.observed_locator)
    with pytest.raises(HandshakeFailed) as exc:
        await s2.handshake()
    assert exc.value.reason is HandshakeReason.PROCESS_FAILED and "active writer" in exc.value.detail


# ---------------------------------------------------------------- retries and failures


async def test_transient_5xx_is_retried_by_the_cli(box: Box) -> None:
    box.fx.add_rules(fail(500, match="flaky", times=1))
    s = await box.start(box.member("m"))
    await s.handshake()
    u1, u2 = "flaky question", "after the flake"
    r1 = ok(await s.run_turn(u1, timeout_s=60))
    assert r1.assistant_text == default_reply([u1])
    statuses = [r.status for r in box.fx.conversation_requests()]
    assert statuses == [500, 200]
    assert box.dialogue(0) == box.dialogue(1) == [Message.user(u1)]
    ok(await s.run_turn(u2, timeout_s=60))
    assert box.dialogue() == [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(u2)]


async def test_retry_notices_then_success(box: Box) -> None:
    box.fx.add_rules(cut(after_deltas=1, match="cut me", times=1))
    s = await box.start(box.member("m"))
    await s.handshake()
    events: list[Any] = []
    r = ok(await s.run_turn("cut me once", emit=events.append, timeout_s=60))
    retries = [e for e in events if isinstance(e, RetryNotice)]
    assert retries and retries[0].attempt == 1
    assert r.assistant_text == default_reply(["cut me once"])
    assert box.dialogue() == [Message.user("cut me once")]


@pytest.mark.parametrize(("rule", "reason", "needle"), [
    (reject(match="FAILME"), FailureReason.API_ERROR, TERMINAL_MESSAGE),
    (reject(match="FAILME", context_window=True), FailureReason.CONTEXT_TOO_LONG, "context window"),
    (fail(429, match="FAILME"), FailureReason.RATE_LIMITED, "429"),
])
async def test_terminal_error_is_a_settled_failure_and_history_survives(box: Box, rule, reason, needle) -> None:
    box.fx.add_rules(rule)
    s = await box.start(box.member("m"))
    await s.handshake()
    u1, u2, u3 = "good start", "FAILME now", "after the failure"
    r1 = ok(await s.run_turn(u1, timeout_s=60))
    r2 = await s.run_turn(u2, timeout_s=60)
    assert isinstance(r2, Settlement) and r2.is_error, r2
    assert r2.reason is reason and needle in (r2.detail or ""), r2
    assert r2.observed_locator == r1.observed_locator == s.locator
    r3 = ok(await s.run_turn(u3, timeout_s=60))
    dialogue = box.dialogue()
    assert r3.assistant_text == default_reply([m.text for m in dialogue if m.role == "user"])
    assert not r2.compacted
    if reason is not FailureReason.CONTEXT_TOO_LONG:
        # the failed query stays in the native history, with no assistant reply
        assert dialogue == [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(u2),
                            Message.user(u3)]
        assert [r.kind for r in box.fx.requests()] == ["conversation"] * 3
        assert not r3.compacted
        return
    # Codex's own recovery from contextWindowExceeded (measured on 0.171.0), whatever the
    # compaction policy (Codex has no switch: drivers/codex/launch.py): the next turn first
    # compacts the thread (a summary side request), then sends [u1, u2, <handoff summary>, u3];
    # a1 survives only inside the summary. The driver reports it.
    assert r3.compacted
    assert [r.kind for r in box.fx.requests()] == ["conversation", "conversation", "summary", "conversation"]
    assert [m.role for m in dialogue] == ["user"] * 4
    assert (dialogue[0].text, dialogue[1].text, dialogue[3].text) == (u1, u2, u3)
    assert "Fixture summary of" in dialogue[2].text


# ---------------------------------------------------------------- interrupt / timeout / cancel / death


async def _until_streaming(box: Box, s: CodexSession) -> None:
    await box.until_stalled()
    while s.active_turn is None:
        await anyio.sleep(0.02)


async def test_interrupt_settles_as_aborted(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.start(box.member("m"))
    await s.handshake()
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def turn() -> None:
            result.append(await s.run_turn("STALL please", timeout_s=60))
        tg.start_soon(turn)
        await _until_streaming(box, s)
        assert await s.interrupt()
    r = result[0]
    assert isinstance(r, Settlement) and r.is_error and r.reason is FailureReason.ABORTED, r
    assert r.observed_locator == Locator(id=s.thread_id)
    ok(await s.run_turn("after interrupt", timeout_s=60))
    assert box.dialogue() == [Message.user("STALL please"), Message.user("after interrupt")]


async def test_timeout_interrupts_then_not_settled(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.start(box.member("m"))
    await s.handshake()
    r = await s.run_turn("STALL forever", timeout_s=3)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.TIMEOUT, r
    assert s.active_turn is None  # the interrupt ended the native turn within the grace
    assert s.transport.alive


async def test_cancellation_interrupts_and_reraises(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.start(box.member("m"))
    await s.handshake()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_soon() -> None:
                await _until_streaming(box, s)
                scope.cancel()
            tg.start_soon(cancel_soon)
            await s.run_turn("STALL then cancel", timeout_s=60)
            pytest.fail("run_turn returned after cancellation")
    assert scope.cancelled_caught
    assert s.active_turn is None


async def test_process_death_mid_turn_is_transport_closed(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.start(box.member("m"))
    await s.handshake()
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def turn() -> None:
            result.append(await s.run_turn("STALL then die", timeout_s=60))
        tg.start_soon(turn)
        await _until_streaming(box, s)
        await box.kill(s)
    assert isinstance(result[0], NotSettled) and result[0].reason is NotSettledReason.TRANSPORT_CLOSED


# ---------------------------------------------------------------- message fidelity, tools, fork


MESSAGES = [
    "first paragraph\n\nsecond paragraph\n\n- a list item\n- another",
    "中文消息：我刚才让你做什么了？",
    "emoji 🚀👩‍💻 and ZWJ sequences 🏳️‍🌈",
    "   leading and trailing whitespace \t\n\n  ",
    '{"type": "message", "role": "system", "content": "json-looking"}',
    "/compact this is not a command",
    "$skill-looking and @mention-looking text",
]


async def test_message_is_sent_unchanged(box: Box) -> None:
    s = await box.start(box.member("m"))
    await s.handshake()
    for text in MESSAGES:
        r = ok(await s.run_turn(text, timeout_s=60))
        assert box.last_user_text() == text
        assert r.assistant_text == default_reply([m.text for m in box.dialogue() if m.role == "user"])


async def test_tool_events_and_the_key_stays_out_of_tools(box: Box) -> None:
    box.fx.add_rules(shell_call("env; echo marker-$((6*7))", match="run env", then_reply="ran it"))
    s = await box.start(box.member("m"))
    await s.handshake()
    events: list[Any] = []
    r = ok(await s.run_turn("run env please", emit=events.append, timeout_s=60))
    assert r.assistant_text == "ran it"
    started = [e for e in events if isinstance(e, ToolStarted)]
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert len(started) == 1 and started[0].tool == "commandExecution"
    assert len(finished) == 1 and finished[0].call_id == started[0].call_id and not finished[0].is_error
    assert "marker-42" in (finished[0].output or "")
    tool_results = [m for m in box.fx.last().conversation() if m.role == "tool_result"]
    assert tool_results and "marker-42" in tool_results[0].text
    assert KEY not in json.dumps([r.body for r in box.fx.requests()])


async def test_fork_at_a_historical_turn_carries_exactly_the_prefix(box: Box) -> None:
    paths = box.member("m")
    s = await box.start(paths)
    await s.handshake()
    u = ["fork one", "fork two", "fork three"]
    replies = [ok(await s.run_turn(t, timeout_s=60)).assistant_text for t in u]
    turn_ids = await s.list_turn_ids()
    assert turn_ids == s.turn_ids
    fork_at = await s.fork(last_turn_id=turn_ids[0])
    fork_all = await s.fork()
    assert len({fork_at.id, fork_all.id, s.thread_id}) == 3
    await box.kill(s)

    before = len(box.fx.conversation_requests())
    f1 = await box.start(paths, resume=fork_at)  # a fresh process resumes the fork from disk
    await f1.handshake()
    r = ok(await f1.run_turn("after fork", timeout_s=60))
    assert r.observed_locator == fork_at
    assert len(box.fx.conversation_requests()) == before + 1
    assert box.dialogue() == [Message.user(u[0]), Message.assistant(replies[0]), Message.user("after fork")]
    assert box.fx.last().headers.get("thread-id") == fork_at.id
    await box.kill(f1)

    f2 = await box.start(paths, resume=fork_all)
    await f2.handshake()
    ok(await f2.run_turn("after full fork", timeout_s=60))
    expected = [m for t, a in zip(u, replies) for m in (Message.user(t), Message.assistant(a))]
    assert box.dialogue() == [*expected, Message.user("after full fork")]


# ---------------------------------------------------------------- capture (CODEX_CAPTURE=1)


# CODEX_CAPTURE=1 re-records the committed streams; otherwise every run still drives the
# same real scenarios (so a CLI that stopped behaving fails here) and writes to a temp dir.
CAPTURE_DIR = DATA if os.environ.get("CODEX_CAPTURE") else Path(tempfile.mkdtemp(prefix="codex-capture-"))


def _write(name: str, log: list[Entry]) -> None:
    CAPTURE_DIR.mkdir(parents=True, exist_ok=True)
    dump_stream(log, CAPTURE_DIR / f"{name}.jsonl")


async def test_capture_streams(box: Box) -> None:
    """Drive the real 0.171.0 through every recorded scenario (handshake + turns, both directions)."""
    box.fx.add_rules(reject(match="FAILME"), reject(match="CTXME", context_window=True),
                     fail(429, match="RATEME"), cut(after_deltas=1, match="CUTME", times=1),
                     shell_call("echo tool-output", match="TOOLME", then_reply="tool finished"),
                     shell_call("touch approval-probe", match="APPROVEME", then_reply="after the approval"),
                     stall(30, match="STALLME"), stall(2, match="SLOWME"))
    scenarios = {
        "success": "hello codex",
        "failed_400": "FAILME please",
        "context_window": "CTXME please",
        "rate_limited": "RATEME please",
        "retry_then_success": "CUTME once",
        "tool_call": "TOOLME please",
        "interrupted": "STALLME please",
    }
    for name, text in scenarios.items():
        log: list[Entry] = []
        s = await box.start(box.member(name), log=log)
        await s.handshake()
        if name == "interrupted":
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.run_turn, text)
                await _until_streaming(box, s)
                await s.interrupt()
        else:
            await s.run_turn(text, timeout_s=60)
        if name == "success":  # a second (LIVE) turn on the same thread
            await s.run_turn("second turn", timeout_s=60)
        _write(name, log)
        await box.kill(s)

    # RESTORED handshake (thread/resume) followed by one turn
    log = []
    s = await box.start(box.member("success"), resume=Locator(id=_thread_of("success")), log=log)
    await s.handshake()
    await s.run_turn("restored turn", timeout_s=60)
    _write("restored", log)
    await box.kill(s)

    log = []
    s = await box.start(box.member("unknown"), resume=Locator(id="01a2297e-8a4e-7000-8000-000000000000"), log=log)
    with pytest.raises(HandshakeFailed):
        await s.handshake()
    _write("resume_unknown", log)

    # A real server-initiated approval request: a per-turn approvalPolicy override (which
    # persists) is set by a raw first turn, then the driver's own turn meets the request.
    log = []
    s = await box.start(box.member("server_request"), log=log)
    await s.handshake()
    mark = len(log)
    await s._request("turn/start", {"threadId": s.thread_id, "approvalPolicy": "untrusted",
                                    "input": [{"type": "text", "text": "set the policy"}]})
    while (m := await s.read_object()) is not None and m.get("method") != "turn/completed":
        pass
    del log[mark:]  # trimmed: the stream starts again at the driver's own turn
    s._next_id = 2
    await s.run_turn("APPROVEME please", timeout_s=60)
    _write("server_request", log)
    await box.kill(s)

    # Another thread's notifications interleaved with ours: fork, start a turn on the fork
    # without reading, then run our (slow) turn on the source thread.
    log = []
    s = await box.start(box.member("foreign"), log=log)
    await s.handshake()
    await s.run_turn("before the fork", timeout_s=60)
    fork = await s.fork()
    await s._request("turn/start", {"threadId": fork.id, "input": [{"type": "text", "text": "foreign turn"}]})
    await s.run_turn("SLOWME mine", timeout_s=60)
    _write("foreign_thread", log)
    await box.kill(s)
    captured = sorted(os.listdir(CAPTURE_DIR))
    assert set(captured) >= set(os.listdir(DATA)) - {"README.md"}, "a recorded scenario was not re-driven"
    if CAPTURE_DIR != DATA:
        # a fresh run against the committed recordings (ids, timestamps and the number of text
        # deltas aside: tests/support/recording_shape.py)
        problems = []
        for name in sorted(p.stem for p in DATA.glob("*.jsonl")):
            fresh = codex_stream_kinds(CAPTURE_DIR / f"{name}.jsonl")
            committed = codex_stream_kinds(DATA / f"{name}.jsonl")
            problems += [f"{name}: {p}" for p in compare(fresh, committed, unordered=_codex_unordered,
                                                         ignored=_codex_racing(name))]
        assert not problems, "the real CLI no longer produces the committed streams (re-record with " \
                             "CODEX_CAPTURE=1 once understood):\n" + "\n".join(problems)


def _codex_racing(scenario: str) -> Callable[[str], bool]:
    # An interrupted turn's rate-limit snapshot races the interrupt: 0.171 sends it when it reads
    # the (stalled) response's head, which the interrupt may cancel first (CI once: absent)
    if scenario != "interrupted":
        return lambda _kind: False
    return lambda kind: kind == "recv account/rateLimits/updated"


def _codex_unordered(kind: str) -> bool:
    # status and telemetry notifications race the turn's own lines; they only have to occur
    return kind.endswith("(other thread)") or kind.split(" ", 1)[1].split(":", 1)[0] in (
        "remoteControl/status/changed", "thread/status/changed", "thread/tokenUsage/updated",
        "account/rateLimits/updated", "warning", "thread/started", "mcpServer/startupStatus/updated")


def _thread_of(name: str) -> str:
    for direction, line in load_stream(CAPTURE_DIR / f"{name}.jsonl"):
        msg = json.loads(line)
        if direction == "recv" and msg.get("id") == 1 and "result" in msg:
            return msg["result"]["thread"]["id"]
    raise AssertionError(f"no thread/start result in {name}")


def test_image_runs_the_native_binary(container) -> None:
    rc, out = container.exec_run(["codex-native", "--version"], user="agent")
    assert rc == 0 and out.decode().strip() == "codex-cli 0.171.0"
    rc, out = container.exec_run(["readlink", "-f", "/usr/local/bin/codex-native"], user="agent")
    assert out.decode().strip().endswith("x86_64-unknown-linux-musl/bin/codex")
