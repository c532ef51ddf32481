"""Replaying recorded bridge traces: the bridge's event logic against real SSE sequences.

``http-agent-live-bridge --trace FILE`` appends every stdin command, SSE event, stream loss,
REST exchange and output line to FILE. :func:`replay` feeds the inputs of such a trace to the
bridge's :class:`Bridge` class again, answering its REST calls from the recorded responses,
and returns the lines it prints, so a test can compare them with the recorded ones. The
captures under tests/data/bridge/ are :func:`trim`-med traces of the real CLIs.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import defaultdict, deque
from functools import lru_cache
from importlib.machinery import SourceFileLoader
from pathlib import Path
from types import ModuleType
from typing import Any

from tests.support.replay import read_jsonl, write_jsonl

BRIDGE_PATH = Path(__file__).resolve().parents[2] / "images" / "sandbox" / "helpers" / "http-agent-live-bridge"

# Events no turn logic reads; dropped from committed captures to keep them small.
NOISE = {"plugin.added", "catalog.updated", "sync", "integration.updated", "reference.updated", "indexing.status",
         "project.updated", "server.instance.disposed", "session.diff", "lsp.updated", "file.watcher.updated"}


@lru_cache(maxsize=1)
def bridge_module() -> ModuleType:
    """The helper script as a module (it has no .py suffix; no bytecode is written next to it)."""
    loader = SourceFileLoader("http_agent_live_bridge", str(BRIDGE_PATH))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    before = sys.dont_write_bytecode
    sys.dont_write_bytecode = True
    try:
        loader.exec_module(module)
    finally:
        sys.dont_write_bytecode = before
    return module


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    return read_jsonl(path)


def dump_trace(records: list[dict[str, Any]], path: str | Path) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(records, path)


def _slim_error(err: Any) -> Any:
    if not isinstance(err, dict):
        return err
    data = err.get("data") if isinstance(err.get("data"), dict) else {}
    return {"name": err.get("name"), "data": {k: data[k] for k in ("message", "statusCode") if k in data}}


def _slim_info(info: Any) -> Any:
    if not isinstance(info, dict):
        return info
    keep = ("id", "sessionID", "parentID", "role", "time", "finish", "title", "directory")
    out = {k: info[k] for k in keep if k in info}
    if "error" in info:
        out["error"] = _slim_error(info["error"])
    return out


def _slim_part(part: Any) -> Any:
    if not isinstance(part, dict):
        return part
    keep = ("id", "messageID", "sessionID", "type", "text", "synthetic", "tool", "callID", "state", "metadata")
    out = {k: part[k] for k in keep if k in part}
    if isinstance(out.get("state"), dict):
        out["state"] = {k: v for k, v in out["state"].items() if k in ("status", "input", "output", "error", "metadata")}
    return out


def trim(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop noise events and the fields no bridge logic reads (tokens, costs, prompts, paths),
    and from transcripts every message that is neither a prompt of this trace nor a reply to one."""
    mine = {r["body"]["messageID"] for r in records
            if r["kind"] == "rest" and r["path"].endswith("/prompt_async") and isinstance(r.get("body"), dict)}
    out = []
    for r in records:
        r = dict(r)
        if r["kind"] == "sse":
            ev = dict(r["event"])
            if ev.get("type") in NOISE:
                continue
            props = dict(ev.get("properties") or {})
            if ev.get("type") == "session.updated" and not (props.get("info") or {}).get("parentID"):
                continue  # only a child's parent link is read from it
            if "error" in props:
                props["error"] = _slim_error(props["error"])
            if "info" in props:
                props["info"] = _slim_info(props["info"])
            if "part" in props:
                props["part"] = _slim_part(props["part"])
            ev["properties"] = props
            ev.pop("id", None)
            r["event"] = ev
        elif r["kind"] == "rest" and isinstance(r.get("response"), list):
            # transcripts: the bridge reads message infos and text parts only
            r["response"] = [{"info": _slim_info(m.get("info")),
                              "parts": [_slim_part(p) for p in m.get("parts") or [] if p.get("type") == "text"]}
                             for m in r["response"] if isinstance(m, dict) and isinstance(m.get("info"), dict)
                             and (m["info"].get("id") in mine or m["info"].get("parentID") in mine)]
        elif r["kind"] == "rest" and isinstance(r.get("response"), dict) and "slug" in r["response"]:
            r["response"] = _slim_info(r["response"])
        out.append(r)
    return out


class FakeRest:
    """Answers the bridge's REST calls with the recorded responses, per (method, path) in order;
    a call made more often than recorded gets the last recorded answer again."""

    def __init__(self, records: list[dict[str, Any]], error_cls: type[Exception]) -> None:
        self.answers: dict[tuple[str, str], deque[dict[str, Any]]] = defaultdict(deque)
        self.last: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, Any]] = []
        self.error_cls = error_cls
        for r in records:
            if r["kind"] == "rest":
                self.answers[(r["method"], r["path"])].append(r)

    def call(self, method: str, path: str, body: Any = None, timeout: float = 0.0) -> Any:
        self.calls.append((method, path, body))
        key = (method, path)
        if self.answers[key]:
            rec = self.last[key] = self.answers[key].popleft()
        elif key in self.last:
            rec = self.last[key]
        else:
            raise self.error_cls(0, f"no recorded answer for {method} {path}")
        status = rec.get("status", 0)
        if "error" in rec or status >= 300 or status == 0:
            raise self.error_cls(status, rec.get("detail") or rec.get("error") or "recorded failure")
        return rec.get("response")


class _RecordedIds:
    """The client-minted user message ids of the recording, in order."""

    def __init__(self, ids: deque[str]) -> None:
        self.ids = ids

    def bump(self, seen: Any) -> None:
        pass

    def __call__(self) -> str:
        return self.ids.popleft() if self.ids else "msg_ffffffffffffZZZZZZZZZZZZZZ"


class _Stream:
    def __init__(self) -> None:
        self.cuts = 0

    def cut(self) -> None:
        self.cuts += 1


def replay(records: list[dict[str, Any]], **bridge_kw: Any) -> list[dict[str, Any]]:
    """Run the recorded inputs through a fresh Bridge; returns its output lines (after hello)."""
    mod = bridge_module()
    outputs: list[dict[str, Any]] = []
    clock = [records[0]["t"] if records else 0.0]
    rest = FakeRest(records, mod.HttpError)
    start = next((r for r in records if r["kind"] == "start"), {})
    runtime = bridge_kw.pop("runtime", start.get("runtime", "opencode"))
    for key in ("title", "question_policy", "fail_replies", "test_seams"):
        if key in start:
            bridge_kw.setdefault(key, start[key])
    bridge = mod.Bridge(runtime, rest, outputs.append, _Stream(), clock=lambda: clock[0], sleep=lambda _s: None,
                        **bridge_kw)
    ids = deque(r["body"]["messageID"] for r in records
                if r["kind"] == "rest" and r["path"].endswith("/prompt_async") and isinstance(r.get("body"), dict))
    bridge.mint = _RecordedIds(ids)
    for r in records:
        clock[0] = max(clock[0], r["t"])
        bridge.on_tick()
        if r["kind"] == "stdin":
            bridge.on_line(r["line"].encode())
        elif r["kind"] == "sse":
            bridge.on_event(r["gen"], r["event"])
        elif r["kind"] == "sse_down":
            bridge.on_stream_down(r["gen"], r["why"])
        else:
            continue
        bridge.on_tick()
    return outputs


def recorded_outputs(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["line"] for r in records if r["kind"] == "out" and r["line"].get("type") != "hello"]
