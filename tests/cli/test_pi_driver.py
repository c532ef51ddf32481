"""The Pi driver against the real pinned pi 0.73.1 inside the pinned image.

Every test drives ``pi --mode rpc`` in a container (sealed: network none, the model through its socket and a proxy in front of the in-process loopback fixture) through ``ca-launch``, with member paths
bind-mounted at the same absolute path. What the model saw is asserted on the fixture's
recorded requests (Anthropic Messages: the driver's API shape).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.cli.driver_harness import DriverBox, box_fixtures, ok

from deploy.loopback import LoopbackFixture, Message, default_reply, fail, reject, shell_call, stall
from deploy.loopback.behaviour import TERMINAL_MESSAGE
from drivers.base import parse_json_line
from drivers.models import (
    DriverOptions,
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
from drivers.pi import PiDriver, PiSession, PiSettings
from drivers.transport import Transport, TransportWrapper, unwrap
from tests.support.local_process import LocalProcessTransport

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

KEY = "sk-pi-fixture-canary-31c9e4"
MODEL = "fixture-model"
SETTINGS = PiSettings(retry_max=2, retry_base_delay_ms=200, handshake_timeout_s=60, abort_grace_s=5)


class StreamWatch(TransportWrapper):
    """Sets ``streaming`` once pi prints the assistant's ``message_start``: pi has read the first
    event of the model's stream (what a test must wait for before interrupting a stalled one)."""

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self.streaming = anyio.Event()

    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        obj = parse_json_line(line) if line is not None else None
        if obj is not None and obj.get("type") == "message_start" and \
                (obj.get("message") or {}).get("role") == "assistant":
            self.streaming.set()
        return line


class Box(DriverBox):
    key = KEY
    shared_workspace = True  # the chat's workspace, shared by its members

    def __init__(self, container: Any, root: Path, fx: LoopbackFixture, name: str) -> None:
        super().__init__(container, root, fx, name)
        self.driver = PiDriver(SETTINGS)
        self.workspace = str(root / "ws")
        self.handshake_s: list[float] = []

    async def start(self, paths: MemberPaths, resume: Locator | None = None, *, launch: Any = None) -> PiSession:
        launch = launch or self.driver.plan(paths, self.gateway, resume)
        return self.driver.session(StreamWatch(await self.launch(launch.spec, paths)), launch)

    async def handshake(self, s: PiSession) -> None:
        t0 = time.monotonic()
        await s.handshake()
        self.handshake_s.append(time.monotonic() - t0)

    async def new(self, name: str = "m") -> PiSession:
        s = await self.start(self.member(name))
        await self.handshake(s)
        return s

    async def shutdown(self) -> None:
        await super().shutdown()
        if self.handshake_s:
            print(f"\n[pi] get_state handshake: {', '.join(f'{x:.2f}s' for x in self.handshake_s)}")


root, container, box = box_fixtures("pi", Box)


def header(locator: Locator) -> dict[str, Any]:
    with open(locator.path or "") as fh:
        return json.loads(fh.readline())


# ---------------------------------------------------------------- NEW / LIVE / RESTORED


async def test_new_live_restored_history(box: Box) -> None:
    paths = box.member("m")
    s = await box.start(paths)
    await box.handshake(s)
    planned = s.reported
    assert planned is not None and not Path(planned.path).exists()  # lazy: no file before a reply
    u1, u2, u3 = "hello pi", "and a follow-up", "after the restore"
    r1 = ok(await s.run_turn(u1, timeout_s=60))
    assert r1.assistant_text == default_reply([u1])
    assert r1.observed_locator == planned == s.locator and s.persisted
    assert header(planned)["id"] == planned.id  # verifiable from the first settled turn on
    r2 = ok(await s.run_turn(u2, timeout_s=60))  # LIVE
    assert box.dialogue() == [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(u2)]
    await box.kill(s)
    s2 = await box.start(paths, resume=r2.observed_locator)  # RESTORED
    await box.handshake(s2)
    assert s2.locator == r2.observed_locator
    r3 = ok(await s2.run_turn(u3, timeout_s=60))
    assert r3.observed_locator == r2.observed_locator
    assert box.dialogue() == [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(u2),
                              Message.assistant(r2.assistant_text), Message.user(u3)]
    assert len(box.fx.conversation_requests()) == 3 and not [r for r in box.fx.requests() if r.kind != "conversation"]
    agent = Path(paths.home) / ".pi" / "agent"
    assert KEY not in (agent / "models.json").read_text() + (agent / "settings.json").read_text()


async def test_first_turn_killed_leaves_nothing_to_restore(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    paths = box.member("m")
    s = await box.start(paths)
    await box.handshake(s)
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def turn() -> None:
            result.append(await s.run_turn("STALL then die", timeout_s=60))
        tg.start_soon(turn)
        await box.until_stalled()
        await box.kill(s)
    assert isinstance(result[0], NotSettled) and result[0].reason is NotSettledReason.TRANSPORT_CLOSED
    assert s.reported is not None and not Path(s.reported.path).exists()  # lazy write: never flushed
    before = len(box.fx.requests())
    s2 = await box.start(paths, resume=s.reported)
    with pytest.raises(HandshakeFailed) as exc:
        await box.handshake(s2)
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING
    assert len(box.fx.requests()) == before


@pytest.mark.parametrize("where", ["missing_in_sessions", "unknown_dir"])
async def test_resume_missing_session_file_is_refused_without_model_requests(box: Box, where: str) -> None:
    paths = box.member("m")
    sessions = PiDriver.sessions_dir(paths)
    path = f"{sessions}/nope.jsonl" if where == "missing_in_sessions" else str(box.root / "elsewhere" / "x.jsonl")
    s = await box.start(paths, resume=Locator(id="01a22a00-0000-7000-8000-000000000000", path=path))
    with pytest.raises(HandshakeFailed) as exc:
        await box.handshake(s)
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING, exc.value
    assert box.fx.requests() == []
    assert not Path(path).exists()  # pi never ran, so it never created a new session there


async def test_resume_file_with_another_id_is_locator_mismatch(box: Box) -> None:
    paths = box.member("m")
    s = await box.new("m")
    r = ok(await s.run_turn("make a session", timeout_s=60))
    await box.kill(s)
    n = len(box.fx.requests())
    assert r.observed_locator is not None
    wrong = Locator(id="01a22a00-1111-7000-8000-000000000000", path=r.observed_locator.path)
    s2 = await box.start(paths, resume=wrong)
    with pytest.raises(HandshakeFailed) as exc:
        await box.handshake(s2)
    assert exc.value.reason is HandshakeReason.LOCATOR_MISMATCH, exc.value
    assert len(box.fx.requests()) == n


# ---------------------------------------------------------------- retries and failures


async def test_transient_5xx_is_retried_with_history_intact(box: Box) -> None:
    box.fx.add_rules(fail(500, match="flaky", times=1))
    s = await box.new()
    u1, u2 = "flaky question", "after the flake"
    events: list[Any] = []
    r1 = ok(await s.run_turn(u1, emit=events.append, timeout_s=60))
    assert r1.assistant_text == default_reply([u1])
    assert [(e.attempt, e.status) for e in events if isinstance(e, RetryNotice)] == [(1, 500)]
    assert [r.status for r in box.fx.conversation_requests()] == [500, 200]
    assert box.dialogue(0) == box.dialogue(1) == [Message.user(u1)]
    ok(await s.run_turn(u2, timeout_s=60))
    assert box.dialogue() == [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(u2)]


async def test_terminal_400_is_a_settled_failure_and_history_survives(box: Box) -> None:
    box.fx.add_rules(reject(match="FAILME"))
    paths = box.member("m")
    s = await box.start(paths)
    await box.handshake(s)
    u1, u2, u3, u4 = "good start", "FAILME now", "after the failure", "after restore"
    r1 = ok(await s.run_turn(u1, timeout_s=60))
    r2 = await s.run_turn(u2, timeout_s=60)
    assert isinstance(r2, Settlement) and r2.is_error and r2.reason is FailureReason.API_ERROR, r2
    assert TERMINAL_MESSAGE in (r2.detail or "") and (r2.detail or "").startswith("400 ")
    assert r2.assistant_text == "" and r2.observed_locator == r1.observed_locator == s.locator
    assert len(box.fx.conversation_requests()) == 2  # one request: a 400 is not retried
    r3 = ok(await s.run_turn(u3, timeout_s=60))
    # pi keeps the failed user message but drops the error assistant message from the model
    # context: the follow-up carries [u1, a1, u2, u3] — two user messages in a row.
    expected = [Message.user(u1), Message.assistant(r1.assistant_text), Message.user(u2), Message.user(u3)]
    assert box.dialogue() == expected
    await box.kill(s)
    s2 = await box.start(paths, resume=r3.observed_locator)
    await box.handshake(s2)
    ok(await s2.run_turn(u4, timeout_s=60))
    assert box.dialogue() == [*expected, Message.assistant(r3.assistant_text), Message.user(u4)]


@pytest.mark.parametrize("compaction", [False, True])
async def test_context_window_refusal_is_context_too_long(box: Box, compaction: bool) -> None:
    box.fx.add_rules(reject(match="HUGE", context_window=True))
    box.driver = PiDriver(SETTINGS, options=DriverOptions(native_compaction=compaction))
    s = await box.new()
    r = await s.run_turn("HUGE input", timeout_s=60)
    assert isinstance(r, Settlement) and r.is_error and r.reason is FailureReason.CONTEXT_TOO_LONG, r
    assert r.compacted is compaction
    if compaction:
        # pi's own overflow recovery: a summary side request, then one re-run that fails again
        assert [q.kind for q in box.fx.requests()] == ["conversation", "summary", "conversation"]
    else:
        assert [q.kind for q in box.fx.requests()] == ["conversation"]  # no summary, no retry
    ok(await s.run_turn("smaller now", timeout_s=60))  # a stale compaction_end is ignored
    if not compaction:
        assert box.dialogue() == [Message.user("HUGE input"), Message.user("smaller now")]


# ---------------------------------------------------------------- interrupt / timeout / cancel / death


async def _until_stalled(box: Box, s: PiSession) -> None:
    """The fixture has begun the stalled answer and pi has read its first event."""
    await box.until_stalled()
    assert isinstance(s.transport, StreamWatch)
    with anyio.fail_after(30):
        await s.transport.streaming.wait()


async def test_interrupt_settles_as_aborted(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.new()
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def turn() -> None:
            result.append(await s.run_turn("STALL please", timeout_s=60))
        tg.start_soon(turn)
        await _until_stalled(box, s)
        assert await s.interrupt()
    r = result[0]
    assert isinstance(r, Settlement) and r.is_error and r.reason is FailureReason.ABORTED, r
    assert r.observed_locator == s.locator
    ok(await s.run_turn("after interrupt", timeout_s=60))
    assert box.dialogue() == [Message.user("STALL please"), Message.user("after interrupt")]


async def test_interrupt_during_retry_sleep_settles_as_aborted(box: Box) -> None:
    box.fx.add_rules(fail(500, match="ALWAYS500"))
    box.driver = PiDriver(SETTINGS.model_copy(update={"retry_base_delay_ms": 20_000}))
    s = await box.new()
    sleeping = anyio.Event()
    result: list[Any] = []

    def emit(e: Any) -> None:
        if isinstance(e, RetryNotice):
            sleeping.set()

    async with anyio.create_task_group() as tg:
        async def turn() -> None:
            result.append(await s.run_turn("ALWAYS500 please", emit=emit, timeout_s=60))
        tg.start_soon(turn)
        with anyio.fail_after(30):
            await sleeping.wait()
        assert await s.interrupt()
    # pi ends the sleep with auto_retry_end{success:false,"Retry cancelled"} and no agent_end
    r = result[0]
    assert isinstance(r, Settlement) and r.is_error and r.reason is FailureReason.ABORTED, r
    assert len(box.fx.conversation_requests()) == 1
    ok(await s.run_turn("after the cancelled retry", timeout_s=60))
    assert box.dialogue() == [Message.user("ALWAYS500 please"), Message.user("after the cancelled retry")]


async def test_timeout_aborts_then_not_settled(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.new()
    r = await s.run_turn("STALL forever", timeout_s=3)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.TIMEOUT, r


async def test_cancellation_aborts_and_reraises(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.new()
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            async def cancel_soon() -> None:
                await _until_stalled(box, s)
                scope.cancel()
            tg.start_soon(cancel_soon)
            await s.run_turn("STALL then cancel", timeout_s=60)
            pytest.fail("run_turn returned after cancellation")
    assert scope.cancelled_caught and s.turn is None


async def test_process_death_mid_turn_is_transport_closed(box: Box) -> None:
    box.fx.add_rules(stall(30, match="STALL"))
    s = await box.new()
    ok(await s.run_turn("first", timeout_s=60))
    result: list[Any] = []
    async with anyio.create_task_group() as tg:
        async def turn() -> None:
            result.append(await s.run_turn("STALL then die", timeout_s=60))
        tg.start_soon(turn)
        await _until_stalled(box, s)
        await box.kill(s)
    assert isinstance(result[0], NotSettled) and result[0].reason is NotSettledReason.TRANSPORT_CLOSED


# ---------------------------------------------------------------- message fidelity, tools, fork


MESSAGES = [
    "first paragraph\n\nsecond paragraph\n\n- a list item\n- another",
    "中文消息：我刚才让你做什么了？",
    "emoji 🚀👩‍💻 and ZWJ sequences 🏳️‍🌈",
    "   leading and trailing whitespace \t\n\n  ",
    '{"type": "prompt", "message": "json-looking", "id": "p1"}',
    "/help",  # a prompt template of that name exists in the workspace and the agent dir
    "/skill:review this",
    "/compact this is not a command",
    "line\u2028separator\u2029and $HOME `id`",
]


async def test_message_is_sent_unchanged(box: Box) -> None:
    paths = box.member("m")
    # Templates pi would expand without --no-prompt-templates (seen on 0.73.1: "/help" then
    # reaches the model as the template body).
    for d in (Path(box.workspace) / ".pi" / "prompts", Path(paths.home) / ".pi" / "agent" / "prompts"):
        d.mkdir(parents=True, exist_ok=True)
        (d / "help.md").write_text("TEMPLATE EXPANDED $@\n")
    s = await box.new()
    for text in MESSAGES:
        r = ok(await s.run_turn(text, timeout_s=60))
        assert box.last_user_text() == text
        assert r.assistant_text == default_reply([m.text for m in box.dialogue() if m.role == "user"])


async def test_tool_events_and_the_key_stays_out_of_tools(box: Box) -> None:
    box.fx.add_rules(shell_call("env; echo marker-$((6*7))", match="run env", then_reply="ran it"))
    s = await box.new()
    events: list[Any] = []
    r = ok(await s.run_turn("run env please", emit=events.append, timeout_s=60))
    assert r.assistant_text == "ran it" and "".join(e.text for e in events if isinstance(e, TextDelta)) == "ran it"
    started = [e for e in events if isinstance(e, ToolStarted)]
    finished = [e for e in events if isinstance(e, ToolFinished)]
    assert len(started) == 1 and started[0].tool == "bash"
    assert len(finished) == 1 and finished[0].call_id == started[0].call_id and not finished[0].is_error
    assert "marker-42" in (finished[0].output or "")
    assert len(box.fx.conversation_requests()) == 2
    # the tool shell ran `env` without the key (settings.shellCommandPrefix unsets it)
    assert "CA_PI_GATEWAY_KEY" not in (finished[0].output or "")
    assert KEY not in json.dumps([q.body for q in box.fx.requests()])
    assert KEY not in Path(r.observed_locator.path).read_text()


async def test_fork_at_a_historical_turn_carries_exactly_the_prefix(box: Box) -> None:
    src_paths = box.member("src")
    s = await box.start(src_paths)
    await box.handshake(s)
    u = ["fork one", "fork two"]
    replies = [ok(await s.run_turn(t, timeout_s=60)).assistant_text for t in u]
    source = s.locator
    assert source is not None and source.path is not None
    src_lines = Path(source.path).read_text()
    await s.close()  # never two pi processes on one session file
    with anyio.move_on_after(10):
        inner = unwrap(s.transport)
        assert isinstance(inner, LocalProcessTransport)
        await inner.wait()
    fork_paths = box.member("fork")
    f = await box.start(fork_paths, launch=box.driver.plan_fork(fork_paths, box.gateway, source))
    await box.handshake(f)
    new = await f.fork(1)
    assert new.id != source.id and new.path is not None
    assert Path(new.path).parent == Path(PiDriver.sessions_dir(fork_paths))  # the new member's own dir
    assert header(new)["id"] == new.id and header(new)["parentSession"] == source.path
    n = len(box.fx.conversation_requests())
    r = ok(await f.run_turn("on the fork", timeout_s=60))
    assert r.observed_locator == new == f.locator
    assert len(box.fx.conversation_requests()) == n + 1
    assert box.dialogue() == [Message.user(u[0]), Message.assistant(replies[0]), Message.user("on the fork")]
    assert Path(source.path).read_text() == src_lines  # the source is untouched
    await box.kill(f)
    f2 = await box.start(fork_paths, resume=new)  # the fork is a normal, restorable session
    await box.handshake(f2)
    ok(await f2.run_turn("fork restored", timeout_s=60))
    assert box.dialogue() == [Message.user(u[0]), Message.assistant(replies[0]), Message.user("on the fork"),
                              Message.assistant(r.assistant_text), Message.user("fork restored")]
