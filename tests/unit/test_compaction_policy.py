"""One native-compaction policy for the five CLIs (CLOUD_AGENT_NATIVE_COMPACTION): the setting
reaches each driver as a launch input and turns that CLI's own switch; a turn in which the CLI
compacted says so in its Settlement. (The CLIs' real behaviour: tests/regression/test_compaction.py.)"""

from __future__ import annotations

import json
import tomllib

import pytest

from drivers.bridge.wire import settlement_from
from drivers.claude.wire import TurnTracker as ClaudeEvidence
from drivers.codex.wire import TurnTracker as CodexEvidence
from drivers.models import DriverOptions, GatewayConfig, Locator, MemberPaths
from drivers.pi.wire import PiTurn
from drivers.registry import get_driver
from runner.config import load_settings
from runner.supervisor import driver_options

PATHS = MemberPaths(home="/home/agent/m/home", workspace="/home/agent/ws", run_dir="/home/agent/m/run")
GW = GatewayConfig(base_url="http://127.0.0.1:9", key="k", model="fixture-model")
SID = "4b41f572-2854-49f2-a737-67c515327768"


def plan(runtime: str, on: bool):
    return get_driver(runtime, DriverOptions(native_compaction=on)).plan(PATHS, GW, None).spec


def files(spec) -> dict[str, str]:
    return {f.path.rsplit("/", 1)[-1]: f.content for f in spec.files}


def test_the_setting_defaults_to_off_and_reaches_the_drivers() -> None:
    assert load_settings({}).native_compaction == "off"
    assert driver_options(load_settings({})).native_compaction is False
    assert driver_options(load_settings({"CLOUD_AGENT_NATIVE_COMPACTION": "on"})).native_compaction is True
    with pytest.raises(ValueError, match="native_compaction"):
        load_settings({"CLOUD_AGENT_NATIVE_COMPACTION": "sometimes"})


@pytest.mark.parametrize("on", [False, True])
def test_claude_switch(on: bool) -> None:
    env = plan("claude", on).env
    assert ("DISABLE_AUTO_COMPACT" in env, "DISABLE_COMPACT" in env) == (not on, not on)
    if not on:
        assert env["DISABLE_AUTO_COMPACT"] == env["DISABLE_COMPACT"] == "1"
    fork = get_driver("claude", DriverOptions(native_compaction=on)).plan_fork(PATHS, GW, Locator(id=SID), None)
    assert ("DISABLE_COMPACT" in fork.spec.env) == (not on)  # a lazy fork's first turn runs the same policy


def test_codex_has_no_switch() -> None:
    """Codex 0.171 compacts after a context-window refusal whatever its config says (its token
    limit is clamped to 90% of the window): the launch is the same, compaction is reported."""
    assert files(plan("codex", False)) == files(plan("codex", True))
    assert not any("compact" in key for key in tomllib.loads(files(plan("codex", False))["config.toml"]))


@pytest.mark.parametrize("on", [False, True])
def test_pi_switch(on: bool) -> None:
    assert json.loads(files(plan("pi", on))["settings.json"])["compaction"] == {"enabled": on}


@pytest.mark.parametrize("runtime", ["opencode", "kilo"])
@pytest.mark.parametrize("on", [False, True])
def test_bridge_switch(runtime: str, on: bool) -> None:
    env = plan(runtime, on).env
    config = json.loads(env[f"{runtime.upper()}_CONFIG_CONTENT"])
    assert config["compaction"] == {"auto": on, "prune": on}


# ---------------------------------------------------------------- the Settlement says so


def claude_turn(with_boundary: bool):
    t = ClaudeEvidence(SID)
    t.feed({"type": "system", "subtype": "init", "session_id": SID})
    if with_boundary:
        t.feed({"type": "system", "subtype": "status", "status": "compacting", "session_id": SID})
        t.feed({"type": "system", "subtype": "compact_boundary", "session_id": SID, "parent_tool_use_id": None})
    t.feed({"type": "result", "subtype": "success", "is_error": False, "result": "ok", "session_id": SID})
    t.feed({"type": "system", "subtype": "session_state_changed", "state": "idle", "session_id": SID})
    assert t.settled
    return t.settlement()


def test_claude_compact_boundary_is_reported() -> None:
    assert claude_turn(True).compacted is True and claude_turn(False).compacted is False
    child = ClaudeEvidence(SID)
    child.feed({"type": "system", "subtype": "init", "session_id": SID})
    child.feed({"type": "system", "subtype": "compact_boundary", "session_id": SID, "parent_tool_use_id": "tu_1"})
    assert child.compacted is False  # a child agent's compaction is not the root session's


@pytest.mark.parametrize("signal", ["thread/compacted", "item"])
def test_codex_compaction_is_reported(signal: str) -> None:
    t = CodexEvidence("th", "tu")
    if signal == "item":
        t.feed({"method": "item/started", "params": {"threadId": "th", "turnId": "tu",
                                                     "item": {"type": "contextCompaction", "id": "c1"}}})
    else:
        t.feed({"method": "thread/compacted", "params": {"threadId": "th", "turnId": "tu"}})
    t.feed({"method": "thread/compacted", "params": {"threadId": "other", "turnId": "x"}})
    t.feed({"method": "turn/completed", "params": {"threadId": "th", "turn": {"id": "tu", "status": "completed"}}})
    assert t.settlement is not None and t.settlement.compacted is True
    plain = CodexEvidence("th", "tu")
    plain.feed({"method": "thread/compacted", "params": {"threadId": "other"}})
    plain.feed({"method": "turn/completed", "params": {"threadId": "th", "turn": {"id": "tu", "status": "completed"}}})
    assert plain.settlement is not None and plain.settlement.compacted is False


def test_pi_compaction_is_reported() -> None:
    turn = PiTurn(prompt_id="p1")
    turn.feed({"type": "response", "id": "p1", "command": "prompt", "success": True})
    turn.feed({"type": "agent_start"})
    end = {"type": "agent_end", "messages": [{"role": "assistant", "stopReason": "stop",
                                             "content": [{"type": "text", "text": "ok"}]}]}
    turn.feed({"type": "compaction_start", "reason": "overflow"})
    turn.feed({"type": "compaction_end", "willRetry": False})
    turn.feed(end)
    turn.barrier_sent("b1")
    step = turn.feed({"type": "response", "id": "b1", "command": "get_state", "success": True,
                      "data": {"isStreaming": False, "isCompacting": False, "sessionId": "s", "sessionFile": "/f"}})
    assert step.settlement is not None and step.settlement.compacted is True


def test_bridge_compaction_is_reported() -> None:
    base = {"type": "settled", "turn_id": "turn-1", "ok": True, "reason": "completed", "session_id": "ses_1", "text": ""}
    assert settlement_from({**base, "compacted": True}, "opencode").compacted is True
    assert settlement_from(base, "opencode").compacted is False
