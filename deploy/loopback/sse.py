"""Render a reply plan as the SSE frames of each API shape (and as a plain JSON body).

Frames are returned as ``(bytes, is_delta)`` so the server can cut a stream after N deltas.
Usage counts stay tiny on purpose: pi compacts when prompt tokens exceed its context window.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from .behaviour import TextOut, ToolOut, split_deltas

Frame = tuple[bytes, bool]
USAGE_IN = 12


def _event(name: str, data: dict[str, Any]) -> bytes:
    return f"event: {name}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode()


def _data(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()


def _out_tokens(items: list[TextOut | ToolOut]) -> int:
    return max(1, sum(len(split_deltas(i.text if isinstance(i, TextOut) else i.arguments)) for i in items))


# ---------------------------------------------------------------- Anthropic Messages


def anthropic_frames(items: list[TextOut | ToolOut], model: str, seq: int) -> Iterator[Frame]:
    mid = f"msg_fx{seq:06d}"
    yield _event("message_start", {"type": "message_start", "message": {
        "id": mid, "type": "message", "role": "assistant", "model": model, "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": USAGE_IN, "output_tokens": 1, "cache_creation_input_tokens": 0,
                  "cache_read_input_tokens": 0}}}), False
    yield _event("ping", {"type": "ping"}), False
    for idx, item in enumerate(items):
        if isinstance(item, TextOut):
            block: dict[str, Any] = {"type": "text", "text": ""}
            deltas = [{"type": "text_delta", "text": d} for d in split_deltas(item.text)]
        else:
            block = {"type": "tool_use", "id": item.call_id, "name": item.name, "input": {}}
            deltas = [{"type": "input_json_delta", "partial_json": d} for d in split_deltas(item.arguments)]
        yield _event("content_block_start", {"type": "content_block_start", "index": idx, "content_block": block}), False
        for d in deltas:
            yield _event("content_block_delta", {"type": "content_block_delta", "index": idx, "delta": d}), True
        yield _event("content_block_stop", {"type": "content_block_stop", "index": idx}), False
    stop = "tool_use" if any(isinstance(i, ToolOut) for i in items) else "end_turn"
    yield _event("message_delta", {"type": "message_delta", "delta": {"stop_reason": stop, "stop_sequence": None},
                                   "usage": {"output_tokens": _out_tokens(items)}}), False
    yield _event("message_stop", {"type": "message_stop"}), False


def anthropic_json(items: list[TextOut | ToolOut], model: str, seq: int) -> dict[str, Any]:
    content = [{"type": "text", "text": i.text} if isinstance(i, TextOut) else
               {"type": "tool_use", "id": i.call_id, "name": i.name, "input": json.loads(i.arguments or "{}")}
               for i in items]
    stop = "tool_use" if any(isinstance(i, ToolOut) for i in items) else "end_turn"
    return {"id": f"msg_fx{seq:06d}", "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": stop, "stop_sequence": None,
            "usage": {"input_tokens": USAGE_IN, "output_tokens": _out_tokens(items)}}


# ---------------------------------------------------------------- OpenAI Responses


def _responses_usage(items: list[TextOut | ToolOut]) -> dict[str, Any]:
    out = _out_tokens(items)
    return {"input_tokens": USAGE_IN, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": out,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": USAGE_IN + out}


def _responses_item(item: TextOut | ToolOut, seq: int, idx: int, done: bool) -> dict[str, Any]:
    if isinstance(item, TextOut):
        return {"id": f"msg_fx{seq:06d}_{idx}", "type": "message", "role": "assistant",
                "status": "completed" if done else "in_progress",
                "content": [{"type": "output_text", "text": item.text, "annotations": []}] if done else []}
    return {"id": f"fc_fx{seq:06d}_{idx}", "type": "function_call", "call_id": item.call_id, "name": item.name,
            "arguments": item.arguments if done else "", "status": "completed" if done else "in_progress"}


def responses_frames(items: list[TextOut | ToolOut], model: str, seq: int) -> Iterator[Frame]:
    rid = f"resp_fx{seq:06d}"
    n = 0

    def ev(name: str, data: dict[str, Any]) -> bytes:
        nonlocal n
        frame = _event(name, {"type": name, "sequence_number": n, **data})
        n += 1
        return frame

    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model, "output": []}
    yield ev("response.created", {"response": {**base, "status": "in_progress"}}), False
    yield ev("response.in_progress", {"response": {**base, "status": "in_progress"}}), False
    for idx, item in enumerate(items):
        added = _responses_item(item, seq, idx, done=False)
        yield ev("response.output_item.added", {"output_index": idx, "item": added}), False
        iid = added["id"]
        if isinstance(item, TextOut):
            loc = {"item_id": iid, "output_index": idx, "content_index": 0}
            yield ev("response.content_part.added", {**loc, "part": {"type": "output_text", "text": "", "annotations": []}}), False
            for d in split_deltas(item.text):
                yield ev("response.output_text.delta", {**loc, "delta": d}), True
            yield ev("response.output_text.done", {**loc, "text": item.text}), False
            yield ev("response.content_part.done", {**loc, "part": {"type": "output_text", "text": item.text, "annotations": []}}), False
        else:
            loc = {"item_id": iid, "output_index": idx}
            for d in split_deltas(item.arguments):
                yield ev("response.function_call_arguments.delta", {**loc, "delta": d}), True
            yield ev("response.function_call_arguments.done", {**loc, "arguments": item.arguments}), False
        yield ev("response.output_item.done", {"output_index": idx, "item": _responses_item(item, seq, idx, done=True)}), False
    yield ev("response.completed", {"response": responses_json(items, model, seq)}), False


def responses_json(items: list[TextOut | ToolOut], model: str, seq: int) -> dict[str, Any]:
    return {"id": f"resp_fx{seq:06d}", "object": "response", "created_at": int(time.time()), "model": model,
            "status": "completed", "output": [_responses_item(i, seq, k, done=True) for k, i in enumerate(items)],
            "usage": _responses_usage(items)}


# ---------------------------------------------------------------- OpenAI Chat Completions


def chat_frames(items: list[TextOut | ToolOut], model: str, seq: int) -> Iterator[Frame]:
    cid, created = f"chatcmpl-fx{seq:06d}", int(time.time())

    def chunk(delta: dict[str, Any], finish: str | None = None) -> bytes:
        return _data({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                      "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

    yield chunk({"role": "assistant", "content": ""}), False
    tool_index = 0
    for item in items:
        if isinstance(item, TextOut):
            for d in split_deltas(item.text):
                yield chunk({"content": d}), True
        else:
            yield chunk({"tool_calls": [{"index": tool_index, "id": item.call_id, "type": "function",
                                         "function": {"name": item.name, "arguments": ""}}]}), False
            for d in split_deltas(item.arguments):
                yield chunk({"tool_calls": [{"index": tool_index, "function": {"arguments": d}}]}), True
            tool_index += 1
    yield chunk({}, "tool_calls" if tool_index else "stop"), False
    out = _out_tokens(items)
    yield _data({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
                 "usage": {"prompt_tokens": USAGE_IN, "completion_tokens": out, "total_tokens": USAGE_IN + out}}), False
    yield _data("[DONE]"), False


def chat_json(items: list[TextOut | ToolOut], model: str, seq: int) -> dict[str, Any]:
    text = "".join(i.text for i in items if isinstance(i, TextOut))
    calls = [{"id": i.call_id, "type": "function", "function": {"name": i.name, "arguments": i.arguments}}
             for i in items if isinstance(i, ToolOut)]
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    out = _out_tokens(items)
    return {"id": f"chatcmpl-fx{seq:06d}", "object": "chat.completion", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "message": msg, "finish_reason": "tool_calls" if calls else "stop"}],
            "usage": {"prompt_tokens": USAGE_IN, "completion_tokens": out, "total_tokens": USAGE_IN + out}}


FRAMES = {"anthropic": anthropic_frames, "responses": responses_frames, "chat": chat_frames}
JSON_BODIES = {"anthropic": anthropic_json, "responses": responses_json, "chat": chat_json}


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """Split an SSE body into ``(event name or None, data)`` pairs (for tests and clients)."""
    events: list[tuple[str | None, str]] = []
    name: str | None = None
    data: list[str] = []
    for line in text.splitlines():
        if not line:
            if data:
                events.append((name, "\n".join(data)))
            name, data = None, []
        elif line.startswith("event:"):
            name = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
    if data:
        events.append((name, "\n".join(data)))
    return events
