"""The bridge's event logic against recorded real SSE sequences (tests/data/bridge/).

Each capture is a trimmed ``--trace`` of the bridge driving real opencode 1.18.33 / kilo 7.7.7
in the pinned image (written by ``BRIDGE_CAPTURE=1 pytest tests/cli/test_bridge_driver.py``).
Replaying its inputs through the Bridge class must print exactly the recorded lines, and the
recorded lines must keep the attribution rules: only assistant text, nothing of the user's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from deploy.loopback import default_reply
from tests.support.bridge_replay import bridge_module, load_trace, recorded_outputs, replay

DATA = Path(__file__).resolve().parents[1] / "data" / "bridge"
CAPTURES = sorted(DATA.glob("*.jsonl"))


def prompts(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in records:
        if r["kind"] == "stdin":
            cmd = json.loads(r["line"])
            if cmd.get("type") == "prompt":
                out.append(cmd["text"])
    return out


def capture(name: str) -> list[dict[str, Any]]:
    return load_trace(DATA / name)


def test_captures_exist() -> None:
    names = {p.name for p in CAPTURES}
    for runtime in ("opencode", "kilo"):
        assert f"test_new_live_restored_history-{runtime}-1.jsonl" in names
        assert f"test_autonomy_and_failures-{runtime}-1.jsonl" in names
    assert "test_kilo_dead_endpoint_ends_turn-1.jsonl" in names


@pytest.mark.parametrize("path", CAPTURES, ids=[p.stem for p in CAPTURES])
def test_replay_prints_the_recorded_lines(path: Path) -> None:
    records = load_trace(path)
    assert replay(records) == recorded_outputs(records)


@pytest.mark.parametrize("path", CAPTURES, ids=[p.stem for p in CAPTURES])
def test_user_text_never_leaks_into_assistant_text(path: Path) -> None:
    records = load_trace(path)
    outs = recorded_outputs(records)
    for text in prompts(records):
        for o in outs:
            if o["type"] == "text":
                assert text not in o["delta"] or o["delta"].startswith("You said: "), (text, o)
    # every text delta belongs to the turn's settled text (assistant-owned, non-synthetic)
    by_turn: dict[str, str] = {}
    for o in outs:
        if o["type"] == "text":
            by_turn[o["turn_id"]] = by_turn.get(o["turn_id"], "") + o["delta"]
        if o["type"] == "settled" and o["turn_id"] in by_turn:
            assert by_turn[o["turn_id"]].replace("\n", "") in o["text"].replace("\n", ""), o


@pytest.mark.parametrize("runtime", ["opencode", "kilo"])
def test_history_capture(runtime: str) -> None:
    records = capture(f"test_new_live_restored_history-{runtime}-1.jsonl")
    settled = [o for o in recorded_outputs(records) if o["type"] == "settled"]
    u1, u2 = prompts(records)
    assert [s["text"] for s in settled] == [default_reply([u1]), "You said: " + u2]
    assert all(s["ok"] and s["reason"] == "completed" for s in settled)


@pytest.mark.parametrize("runtime", ["opencode", "kilo"])
def test_autonomy_capture(runtime: str) -> None:
    records = capture(f"test_autonomy_and_failures-{runtime}-1.jsonl")
    outs = recorded_outputs(records)
    reasons = [(s["ok"], s["reason"]) for s in outs if s["type"] == "settled"]
    assert reasons == [(False, "permission_failed"), (True, "completed"), (True, "completed"), (True, "completed"),
                       (False, "stream_lost"), (False, "error"), (False, "error"), (True, "completed")]
    perms = [o for o in outs if o["type"] == "permission"]
    assert [(p["ok"], p["attempts"]) for p in perms] == [(False, 3), (True, 2), (True, 1)]
    root = next(o for o in outs if o["type"] == "opened")["session_id"]
    assert perms[2]["session_id"] != root  # the Task child's request
    events = [r["event"] for r in records if r["kind"] == "sse"]
    asked = [e["properties"]["id"] for e in events if e.get("type") == "question.asked"]
    replied = [e["properties"]["requestID"] for e in events if e.get("type") == "question.replied"]
    [question] = [o for o in outs if o["type"] == "question"]
    assert asked == replied == [question["id"]]
    assert any(r["kind"] == "sse_down" for r in records)


def test_kilo_offline_capture() -> None:
    records = capture("test_kilo_dead_endpoint_ends_turn-1.jsonl")
    outs = recorded_outputs(records)
    [net] = [o for o in outs if o["type"] == "network"]
    [s] = [o for o in outs if o["type"] == "settled"]
    assert net["reply"] == "reject" and net["ok"] is True
    assert s["ok"] is False and s["reason"] == "offline"
    assert any(r["kind"] == "rest" and r["path"] == f"/network/{net['id']}/reject" for r in records)


class _Transcript:
    """REST answers derived from a raw event recording: the final message infos and parts."""

    def __init__(self, events: list[dict[str, Any]]) -> None:
        self.infos: dict[str, dict[str, Any]] = {}
        self.parts: dict[str, dict[str, Any]] = {}
        for e in events:
            p = e.get("properties", {})
            if e["type"] == "message.updated":
                self.infos[p["info"]["id"]] = p["info"]
            elif e["type"] == "message.part.updated":
                self.parts[p["part"]["id"]] = p["part"]
            elif e["type"] == "message.part.removed":
                self.parts.pop(p["partID"], None)

    def call(self, method: str, path: str, body: Any = None, timeout: float = 0.0) -> Any:
        if path == "/session/status":
            return {}
        if "/message" in path:
            return [{"info": info, "parts": [p for p in self.parts.values() if p["messageID"] == mid]}
                    for mid, info in self.infos.items()]
        return {"id": path.split("/")[2]} if method == "GET" else None


def test_kilo_transient_synthetic_part_is_never_assistant_text() -> None:
    """Kilo 7.7.7's first turn in a git workspace (recorded on the host, same pinned binary): a
    synthetic "Initializing snapshot" spinner part on the assistant message, later removed."""
    records = load_trace(DATA / "events" / "kilo-synthetic-part.jsonl")
    events = [r["event"] for r in records]
    synthetic = [e["properties"]["part"] for e in events
                 if e["type"] == "message.part.updated" and e["properties"]["part"].get("synthetic")]
    assert synthetic and "Initializing snapshot" in synthetic[0]["text"]
    user = next(e["properties"]["info"] for e in events
                if e["type"] == "message.updated" and e["properties"]["info"]["role"] == "user")
    assert synthetic[0]["messageID"] != user["id"]  # on the assistant message, not the user's
    # as if the part had not been removed yet when the turn settled
    rest = _Transcript([e for e in events if e["type"] != "message.part.removed"])
    out: list[dict[str, Any]] = []
    B = bridge_module()
    bridge = B.Bridge("kilo", rest, out.append, None, clock=lambda: 0.0, sleep=lambda _s: None)

    class Ids:
        def bump(self, _x: Any) -> None:
            pass

        def __call__(self) -> str:
            return user["id"]

    bridge.mint = Ids()
    bridge.on_event(1, events[0])
    bridge.on_line(json.dumps({"type": "open", "session_id": user["sessionID"]}).encode())
    bridge.on_line(b'{"type":"prompt","turn_id":"t1","text":"ping one"}')
    for e in events[1:]:
        bridge.on_event(1, e)
    [settled] = [o for o in out if o["type"] == "settled"]
    assert settled["ok"] and settled["text"] == "Hello from fixture"
    assert "".join(o["delta"] for o in out if o["type"] == "text") == "Hello from fixture"
    assert "Initializing" not in json.dumps(out)
