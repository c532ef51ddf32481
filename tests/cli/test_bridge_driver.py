"""The OpenCode/Kilo driver and its live bridge against the real pinned CLIs in the pinned image.

Every test runs ``http-agent-live-bridge`` (which starts ``opencode serve`` / ``kilo serve``)
in one container per module (sealed: network none, the model through its socket and a proxy in front of the in-process loopback fixture, ``--init``, user ``agent``) through ``ca-launch``, with member paths bind-mounted at
the same absolute path. What the model saw is asserted on the fixture's recorded requests.
Server starts are CPU-heavy (4-8 s each), so each test reuses one bridge for many cases.

``BRIDGE_CAPTURE=1`` also writes the bridges' traces, trimmed, to tests/data/bridge/ (the
recorded real SSE sequences the unit tests replay). ``BRIDGE_DEV_MOUNT=1`` bind-mounts the
working copy of the helper over the image's (with ``BRIDGE_DEV_IMAGE=<tag>``: iterating on the
helper without an image rebuild; acceptance runs use neither).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import anyio
import pytest
from tests.cli.driver_harness import DriverBox, box_fixtures, ok

from deploy.loopback import (
    LoopbackFixture,
    Message,
    context_too_long,
    default_reply,
    recall,
    reject,
    shell_call,
    stall,
    tool_call,
)
from drivers.bridge import BridgeDriver
from drivers.bridge.launch import native_db
from drivers.bridge.session import BridgeSession
from drivers.models import (
    DriverOptions,
    FailureReason,
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    Notice,
    NotSettled,
    NotSettledReason,
    Settlement,
    TextDelta,
    ToolFinished,
    ToolStarted,
)
from images.pins import load_pins
from tests.support.bridge_replay import BRIDGE_PATH, dump_trace, load_trace, trim
from tests.support.recording_shape import bridge_kind, compare

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

KEY = "sk-bridge-fixture-canary-3e91d0"
MODEL = "fixture-model"
DATA = Path(__file__).resolve().parents[1] / "data" / "bridge"
CAPTURE = os.environ.get("BRIDGE_CAPTURE") == "1"
DEV_MOUNT = os.environ.get("BRIDGE_DEV_MOUNT") == "1"
RUNTIMES = ["opencode", "kilo"]
TURN_S = 90.0


class Box(DriverBox):
    key = KEY

    def __init__(self, container: Any, root: Path, fx: LoopbackFixture, name: str) -> None:
        super().__init__(container, root, fx, name)
        self.traces: list[Path] = []

    async def start(self, paths: MemberPaths, runtime: str, resume: Locator | None = None, *,
                    bridge_args: tuple[str, ...] = (), config: dict[str, Any] | None = None,
                    gateway: GatewayConfig | None = None, git: bool = False) -> BridgeSession:
        trace = self.next_run_dir(paths) / "trace.jsonl"
        self.traces.append(trace)
        driver = BridgeDriver(runtime, DriverOptions(helper_version=load_pins().helper.version),
                              bridge_args=("--trace", str(trace), *bridge_args), config_overrides=config)
        launch = driver.plan(paths, gateway or self.gateway, resume)
        assert KEY not in json.dumps([launch.spec.argv, [f.content for f in launch.spec.files]])
        t = await self.launch(launch.spec, paths, setup_workspace=self._git_commit if git else None)
        return driver.session(t, launch)

    def _git_commit(self, ws: Path) -> None:
        if not (ws / ".git").exists():
            # a repository with a commit: the snapshot case (Kilo's transient synthetic part)
            self.exec("sh", "-c", f"cd '{ws}' && git init -q && echo hello > README.md && git add . && "
                      "git -c user.email=t@t -c user.name=t commit -qm init")

    def servers(self) -> list[str]:
        _, out = self.container.exec_run(["ps", "-eo", "pid,args"], user="agent")
        return [line for line in out.decode().splitlines() if " serve --port" in line]

    async def shutdown(self) -> None:
        await super().shutdown()
        problems = []
        for i, trace in enumerate(self.traces, 1):
            committed = DATA / f"{self.name}-{i}.jsonl"
            if not trace.exists():
                continue
            if CAPTURE:
                dump_trace(trim(load_trace(trace)), committed)
            elif committed.exists():
                # this run against the committed capture: what the bridge printed, in order, and
                # which SSE event types the server sent (ids, timestamps, delta counts aside)
                fresh = [bridge_kind(r) for r in trim(load_trace(trace))]
                recorded = [bridge_kind(r) for r in load_trace(committed)]
                problems += [f"{committed.name}: {p}" for p in compare(fresh, recorded, unordered=_racing,
                                                                        ignored=_timing)]
        assert not problems, "the real CLI no longer produces the committed traces (re-record with " \
                             "BRIDGE_CAPTURE=1 once understood):\n" + "\n".join(problems)


def _racing(kind: str) -> bool:
    """Lines whose order against the turn's own is a race of one run: SSE events (and the REST
    calls they trigger) and the bridge's autonomous replies/status."""
    return not kind.startswith("out ") or kind in ("out status", "out permission", "out question", "out network")


def _timing(kind: str) -> bool:
    """What only a run's timing decides: heartbeats, Kilo's transient synthetic part, whether a
    retry/offline status was seen before an abort."""
    return kind in ("sse server.heartbeat", "sse message.part.removed", "out status")


@pytest.fixture(scope="module")
def image(request) -> str:
    if DEV_MOUNT and os.environ.get("BRIDGE_DEV_IMAGE"):
        return os.environ["BRIDGE_DEV_IMAGE"]  # any earlier build: the helper is mounted over it
    return request.getfixturevalue("sandbox_image")


root, container, box = box_fixtures(
    "bridge", Box, image="image", name_sep="-",
    mounts={str(BRIDGE_PATH): {"bind": "/usr/local/bin/http-agent-live-bridge", "mode": "ro"}} if DEV_MOUNT else None)


def failed(outcome: Any, reason: FailureReason) -> Settlement:
    assert isinstance(outcome, Settlement), outcome
    assert outcome.is_error and outcome.reason is reason, outcome
    return outcome


def texts(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


# ---------------------------------------------------------------- NEW / LIVE / RESTORED, fork


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_new_live_restored_history(box: Box, runtime: str) -> None:
    box.fx.add_rules(recall(-1, prefix="You said: ", match="quote me"))
    paths = box.member("m")
    s = await box.start(paths, runtime, git=True)
    await s.handshake()
    assert s.cli_version == load_pins().cli[runtime].version
    assert s.session_id and s.session_id.startswith("ses_") and s.locator is None

    u1 = "first question alpha"
    ev1: list[Any] = []
    r1 = ok(await s.run_turn(u1, emit=ev1.append, timeout_s=TURN_S))
    a1 = default_reply([u1])
    assert r1.assistant_text == texts(ev1) == a1
    assert r1.observed_locator == Locator(id=s.session_id) == s.locator
    assert box.dialogue() == [Message.user(u1)]

    # LIVE; the text is sent byte for byte, and a reply quoting it is exactly what the fixture said
    u2 = ("  quote me: first paragraph\n\nsecond paragraph 你好 🙂\n"
          '{"type":"prompt","turn_id":"x"}\n/help --not-a-command  \n')
    ev2: list[Any] = []
    r2 = ok(await s.run_turn(u2, emit=ev2.append, timeout_s=TURN_S))
    a2 = "You said: " + u2
    assert r2.assistant_text == texts(ev2) == a2
    assert box.dialogue() == [Message.user(u1), Message.assistant(a1), Message.user(u2)]
    u2_id = r2.raw[0]["message_id"]

    # fork (for later): messageID forks BEFORE the given message
    fork = await s.fork(message_id=u2_id)
    assert fork.id != s.session_id

    await box.kill(s)
    assert box.servers() == []  # the server died with the bridge's process group
    s2 = await box.start(paths, runtime, resume=r2.observed_locator, git=True)  # RESTORED
    await s2.handshake()
    assert s2.locator == r2.observed_locator
    u3 = "third question gamma"
    r3 = ok(await s2.run_turn(u3, timeout_s=TURN_S))
    assert r3.observed_locator == r2.observed_locator
    assert r3.assistant_text == default_reply([u1, u2, u3])
    assert box.dialogue() == [Message.user(u1), Message.assistant(a1), Message.user(u2), Message.assistant(a2),
                              Message.user(u3)]

    # the fork's first request carries exactly the shorter prefix (test-only switch of session)
    await s2.send_object({"type": "open", "session_id": fork.id})
    u4 = "fork question delta"
    r4 = await s2.run_turn(u4, timeout_s=TURN_S)
    assert isinstance(r4, Settlement) and r4.observed_locator == fork and not r4.is_error
    assert box.dialogue() == [Message.user(u1), Message.assistant(a1), Message.user(u4)]
    assert s2.locator == r2.observed_locator  # a different observed id never replaced the locator
    await s2.close()  # `close`: the bridge stops its server and exits
    with anyio.fail_after(20):
        assert await s2.transport.wait() == 0  # type: ignore[attr-defined]
    assert box.servers() == []

    # side requests: a title request, if any, is classified as such, never as conversation
    kinds = {r.kind for r in box.fx.requests()}
    assert kinds <= {"conversation", "title"}, kinds
    assert len(box.fx.conversation_requests()) == 4

    # native state missing: an unknown id on a live store, and a member with no store at all
    s3 = await box.start(paths, runtime, resume=Locator(id="ses_0000000000001NotARealSession"))
    with pytest.raises(HandshakeFailed) as exc:
        await s3.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING
    other = box.member("empty")
    assert not Path(native_db(runtime, other.home)).exists()
    s4 = await box.start(other, runtime, resume=r2.observed_locator)
    with pytest.raises(HandshakeFailed) as exc:
        await s4.handshake()
    assert exc.value.reason is HandshakeReason.NATIVE_STATE_MISSING


# ---------------------------------------------------------------- permissions, questions, failures


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_autonomy_and_failures(box: Box, runtime: str) -> None:
    fx = box.fx
    fx.add_rules(
        shell_call("echo root-perm-output", match="run-bash", then_reply="bash done"),
        tool_call("task", {"description": "sub probe", "prompt": "child-task: run echo", "subagent_type": "general"},
                  match="run-task", then_reply="task done"),
        shell_call("echo child-perm-output", match="child-task", then_reply="child done"),
        tool_call("question", {"questions": [{"question": "Pick one?", "header": "Pick", "options": [
            {"label": "Alpha", "description": "first"}, {"label": "Beta", "description": "second"}]}]},
            match="run-question", then_reply="question done"),
        stall(60, match="stall-me"),
        reject("fixture says no: bad field", match="reject-me"),
        context_too_long(match="huge-me"),
    )
    # every bash call asks (config-level, so Task children ask too); the first 4 replies fail
    s = await box.start(box.member("m"), runtime, config={"permission": {"bash": "ask"}},
                        bridge_args=("--test-seams", "--test-fail-permission-replies", "4"))
    await s.handshake()
    sent: list[str] = []

    async def turn(text: str, **kw: Any) -> tuple[Any, list[Any]]:
        events: list[Any] = []
        sent.append(text)
        return await s.run_turn(text, emit=events.append, timeout_s=kw.get("timeout_s", TURN_S)), events

    def notices(events: list[Any], name: str) -> list[dict[str, Any]]:
        return [e.raw for e in events if isinstance(e, Notice) and e.name == name]

    # a permanently failing one-shot reply (3 attempts) aborts the turn: a failed turn, no hang
    r, ev = await turn("run-bash one")
    failed(r, FailureReason.ABORTED)
    assert "permission_failed" in (r.detail or "")
    [p] = notices(ev, "permission")
    assert p["ok"] is False and p["attempts"] == 3 and p["session_id"] == s.session_id

    # a failed reply is retried (the 4th injected failure, then success)
    r, ev = await turn("run-bash two")
    assert ok(r).assistant_text == "bash done"
    [p] = notices(ev, "permission")
    assert p["ok"] is True and p["attempts"] == 2 and p["reply"] == "once"
    assert any(isinstance(e, ToolStarted) and e.tool == "bash" for e in ev)
    assert any(isinstance(e, ToolFinished) and "root-perm-output" in (e.output or "") for e in ev)

    # a Task child session's permission is answered too
    r, ev = await turn("run-task three")
    assert ok(r).assistant_text == "task done"
    [p] = notices(ev, "permission")
    assert p["ok"] is True and p["session_id"] != s.session_id
    assert any("child-perm-output" in json.dumps(req.body) for req in fx.conversation_requests())

    # a question gets a reply correlated to its id (default policy: the first option)
    r, ev = await turn("run-question four")
    assert ok(r).assistant_text == "question done"
    [q] = notices(ev, "question")
    assert q["ok"] is True and q["answers"] == [["Alpha"]] and q["id"].startswith("que_")
    trace = load_trace(box.traces[-1])
    replied = [x["event"]["properties"] for x in trace
               if x["kind"] == "sse" and x["event"].get("type") == "question.replied"]
    assert [x["requestID"] for x in replied] == [q["id"]] and replied[0]["answers"] == [["Alpha"]]
    results = [m.text for m in fx.conversation_requests()[-1].conversation() if m.role == "tool_result"]
    assert any('"Pick one?"="Alpha"' in t for t in results), results

    # losing the event stream mid-turn aborts the native turn; REST confirms it ended
    async with anyio.create_task_group() as tg:
        async def cut() -> None:
            await anyio.to_thread.run_sync(lambda: fx.wait_for(
                lambda rs: any(x.kind == "conversation" and "stall-me" in json.dumps(x.body) for x in rs), 60))
            await s.send_object({"type": "_cut_stream"})
        tg.start_soon(cut)
        started = time.monotonic()
        r, ev = await turn("stall-me five")
    failed(r, FailureReason.ABORTED)
    assert (r.detail or "").startswith("stream_lost") and time.monotonic() - started < 30

    # terminal 400s are settled failures; the context-window wording is recognised
    r, _ = await turn("reject-me six")
    assert "fixture says no" in (failed(r, FailureReason.API_ERROR).detail or "")
    r, _ = await turn("huge-me seven")
    failed(r, FailureReason.CONTEXT_TOO_LONG)

    # ... and the follow-up still carries every earlier user message, in order
    r, _ = await turn("after all eight")
    ok(r)
    users = [m.text for m in box.dialogue() if m.role == "user"]
    assert users == sent, users
    await s.close()


async def test_kilo_dead_endpoint_ends_turn(box: Box) -> None:
    """No internet + a dead model endpoint: Kilo asks to go 'offline'; the bridge rejects it."""
    dead = GatewayConfig(base_url="http://127.0.0.1:9", key=KEY, model=MODEL)
    s = await box.start(box.member("m"), "kilo", gateway=dead)
    await s.handshake()
    events: list[Any] = []
    started = time.monotonic()
    r = await s.run_turn("anyone there?", emit=events.append, timeout_s=60)
    assert isinstance(r, Settlement) and r.is_error, r
    assert time.monotonic() - started < 60
    assert r.raw[0]["reason"] in ("offline", "error")
    # SIGTERM to the bridge: it stops the server (its own process group) and exits
    pgid = (box.procs[-1][1] / "cli.pid").read_text().strip()
    box.exec("kill", "-TERM", pgid)
    with anyio.fail_after(20):
        await s.transport.wait()  # type: ignore[attr-defined]
    assert box.servers() == []


async def test_opencode_timeout_aborts(box: Box) -> None:
    """OpenCode retries a dead endpoint for about a minute: the driver's timeout wins, the
    bridge aborts the native turn, and the outcome is NotSettled."""
    dead = GatewayConfig(base_url="http://127.0.0.1:9", key=KEY, model=MODEL)
    s = await box.start(box.member("m"), "opencode", gateway=dead)
    await s.handshake()
    events: list[Any] = []
    r = await s.run_turn("anyone there?", emit=events.append, timeout_s=8)
    assert isinstance(r, NotSettled) and r.reason is NotSettledReason.TIMEOUT, r
    trace = load_trace(box.traces[-1])
    assert any(x["kind"] == "rest" and x["path"].endswith("/abort") for x in trace)
    await s.close()
