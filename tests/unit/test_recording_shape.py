"""The comparison the capture tests run between a fresh real-CLI run and the committed recordings
(tests/support/recording_shape.py): blind to ids, timestamps and delta counts, not to protocol."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.bridge_replay import load_trace
from tests.support.recording_shape import bridge_kind, claude_kind, codex_kind, compare, stream_kinds

DATA = Path(__file__).resolve().parents[1] / "data"


def rewrite(src: Path, dst: Path, fn) -> Path:
    lines = [fn(json.loads(line)) for line in src.read_text().splitlines() if line.strip()]
    dst.write_text("".join(json.dumps(x) + "\n" for x in lines if x is not None))
    return dst


def test_same_protocol_with_other_ids_and_delta_counts_compares_equal(tmp_path: Path) -> None:
    src = DATA / "codex" / "success.jsonl"

    def scramble(rec: dict) -> dict:
        obj = json.loads(rec["line"])
        if "params" in obj and isinstance(obj["params"], dict) and "threadId" in obj["params"]:
            obj["params"]["threadId"] = "01a2ffff-0000-7000-8000-000000000000"
        return {**rec, "line": json.dumps(obj)}

    fresh = stream_kinds(rewrite(src, tmp_path / "fresh.jsonl", scramble), codex_kind)
    more_deltas = [x for k in fresh for x in ([k, k] if "delta" in k else [k])]  # the reply cut finer
    assert len(more_deltas) > len(fresh)
    assert compare(more_deltas, stream_kinds(src, codex_kind)) == []


def test_a_changed_protocol_is_named() -> None:
    success = stream_kinds(DATA / "claude" / "success.jsonl", claude_kind)
    retry = stream_kinds(DATA / "claude" / "retry.jsonl", claude_kind)
    problems = compare(retry, success)
    assert any("system/api_retry" in p for p in problems) and any("order differs" in p for p in problems)
    # a vanished event type, and a reshaped one (a field more), are both reported
    without_idle = [k for k in success if "session_state_changed" not in k]
    assert any("the fresh run lacks" in p and "session_state_changed" in p for p in compare(without_idle, success))
    reshaped = [k.replace("[message,", "[extra,message,") for k in success]
    assert compare(reshaped, success) != []


def test_unordered_kinds_only_have_to_occur() -> None:
    kinds = stream_kinds(DATA / "codex" / "success.jsonl", codex_kind)
    moved = [k for k in kinds if "tokenUsage" not in k] + [k for k in kinds if "tokenUsage" in k]
    assert compare(moved, kinds) != []
    assert compare(moved, kinds, unordered=lambda k: "tokenUsage" in k) == []


def test_bridge_traces_compare_what_the_bridge_printed() -> None:
    one = [bridge_kind(r) for r in load_trace(DATA / "bridge" / "test_new_live_restored_history-opencode-1.jsonl")]
    other = [bridge_kind(r) for r in load_trace(DATA / "bridge" / "test_opencode_timeout_aborts-1.jsonl")]
    assert compare(one, one) == []
    assert compare(other, one, unordered=lambda k: not k.startswith("out ")) != []
