"""The protocol shape of a recorded stream, to compare a fresh capture with the committed one.

A fresh run of a real CLI differs from the committed recording in ids, timestamps, paths, token
counts and how many text deltas a reply is cut into; none of that is protocol. What is, and what
a CLI upgrade changes, is *which* lines come and in *what order*: a line's kind is its direction
plus its type/subtype (Claude, the bridge's output) or its JSON-RPC method / response (Codex), with
the item type for Codex item events, and its top-level field names. :func:`compare` then checks

* the same kinds occur (a new, vanished or reshaped event type fails), and
* the kinds that decide settlement and identity come in the same order (runs of one kind collapsed,
  so the number of deltas does not matter). Kinds named in ``unordered`` (telemetry that races
  the turn's lines) only have to occur; ``ignored`` ones (what depends on timing alone, such as
  heartbeats) are not compared.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any


def _keys(obj: dict[str, Any]) -> str:
    return ",".join(sorted(obj))


def claude_kind(direction: str, obj: Any) -> str:
    if not isinstance(obj, dict):
        return f"{direction} raw"
    kind = str(obj.get("type"))
    if kind in ("system", "control_request", "control_response"):
        sub = obj.get("subtype") or (obj.get("request") or {}).get("subtype") or (obj.get("response") or {}).get(
            "subtype")
        kind = f"{kind}/{sub}"
    if kind in ("assistant", "user") and obj.get("parent_tool_use_id") is not None:
        kind += "(child)"
    return f"{direction} {kind} [{_keys(obj)}]"


def codex_kind(direction: str, obj: Any) -> str:
    if not isinstance(obj, dict):
        return f"{direction} raw"
    method = obj.get("method")
    if isinstance(method, str):
        kind = method + ("?" if "id" in obj else "")  # a request of the server's has an id
        item = (obj.get("params") or {}).get("item")
        if method.startswith("item/") and isinstance(item, dict):
            kind += f":{item.get('type')}"
        return f"{direction} {kind}"
    return f"{direction} {'error' if 'error' in obj else 'response'}"


def bridge_kind(record: dict[str, Any]) -> str:
    """A bridge trace record: the type of a line the bridge printed (its fields are the helper's
    own, not the CLI's), or the type of an SSE event the server sent it."""
    if record.get("kind") == "out":
        return f"out {(record.get('line') or {}).get('type')}"
    if record.get("kind") == "sse":
        return f"sse {(record.get('event') or {}).get('type')}"
    return str(record.get("kind"))


def codex_stream_kinds(path: Any) -> list[str]:
    """Codex kinds, with notifications of a thread other than the recording's own (the one its
    thread/start or thread/resume answered) marked ``(other thread)``: their interleaving with
    ours is timing, not protocol."""
    kinds, own = [], None
    for text in open(path, encoding="utf-8").read().splitlines():
        if not text.strip():
            continue
        rec = json.loads(text)
        try:
            obj = json.loads(rec["line"])
        except ValueError:
            obj = None
        kind = codex_kind(rec["dir"], obj)
        if isinstance(obj, dict):
            thread = ((obj.get("result") or {}).get("thread") or {}).get("id") if "result" in obj else None
            if own is None and isinstance(thread, str):
                own = thread
            tid = (obj.get("params") or {}).get("threadId") if isinstance(obj.get("params"), dict) else None
            if own is not None and isinstance(tid, str) and tid != own:
                kind += " (other thread)"
        kinds.append(kind)
    return kinds


def collapse(kinds: Iterable[str]) -> list[str]:
    out: list[str] = []
    for k in kinds:
        if not out or out[-1] != k:
            out.append(k)
    return out


def compare(fresh: list[str], committed: list[str], *, unordered: Callable[[str], bool] = lambda _k: False,
            ignored: Callable[[str], bool] = lambda _k: False) -> list[str]:
    """What differs between two shapes (empty: the same protocol). ``unordered`` kinds must occur
    in both but may move; ``ignored`` kinds (timing: heartbeats, races of one run) are not compared."""
    problems = []
    fresh = [k for k in fresh if not ignored(k)]
    committed = [k for k in committed if not ignored(k)]
    if new := sorted(set(fresh) - set(committed)):
        problems.append(f"kinds the committed recording lacks: {new}")
    if gone := sorted(set(committed) - set(fresh)):
        problems.append(f"kinds the fresh run lacks: {gone}")
    a = collapse(k for k in fresh if not unordered(k))
    b = collapse(k for k in committed if not unordered(k))
    if a != b:
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        problems.append(f"order differs at {at}: fresh {a[at:at + 4]} vs committed {b[at:at + 4]}")
    return problems


def stream_kinds(path: Any, kind: Callable[[str, Any], str]) -> list[str]:
    """Kinds of a ``{"dir", "line"}`` recording (tests/support/replay.py) or of Claude's
    ``{"d", "o"|"raw"}`` format (its first line is a header)."""
    out = []
    for text in open(path, encoding="utf-8").read().splitlines():
        if not text.strip():
            continue
        rec = json.loads(text)
        if "dir" in rec:
            try:
                obj = json.loads(rec["line"])
            except ValueError:
                obj = None
            out.append(kind(rec["dir"], obj))
        elif "d" in rec:
            out.append(kind(rec["d"], rec.get("o")))
    return out
