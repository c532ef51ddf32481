"""The assistant text a model response carried, read from the bytes as they stream past.

The wire verdict expects the next turn to start with the member's last conversation
*followed by that turn's reply* (SPEC 12). The proxy sees the reply go by, so it digests it
itself, by the same rules as a request: the content blocks (Anthropic), output items
(Responses) or message (Chat) are digested as the assistant message the CLI will send back.

The reader is fed every response chunk and never raises: a response it cannot read (not
2xx, not JSON/SSE, cut short) simply has no reply.
"""

from __future__ import annotations

import json
from typing import Any

from .digest import TextMessage, text_messages

MAX_JSON_BODY = 16 << 20  # a non-streamed reply larger than this is not digested
_WANTED = {"anthropic": (b'"content_block_start"', b'"content_block_delta"'),
           "responses": (b'"response.output_item.done"', b'"response.completed"')}


class ReplyReader:
    """Feed response chunks with :meth:`feed`; :meth:`result` gives the assistant messages."""

    def __init__(self, api: str | None, content_type: str | None) -> None:
        self.api = api
        self.sse = "text/event-stream" in (content_type or "").lower()
        self._buf = bytearray()
        self._json = bytearray()
        self._too_big = False
        self._blocks: dict[int, dict[str, Any]] = {}  # anthropic content blocks by index
        self._items: list[dict[str, Any]] = []  # responses output items (done)
        self._completed: list[dict[str, Any]] | None = None  # responses response.completed output
        self._chat: list[str] = []
        self.broken = False
        # events worth parsing (a substring test is much cheaper than json.loads of every frame)
        self._wanted = _WANTED.get(api or "")

    def feed(self, chunk: bytes) -> None:
        if self.broken or self.api is None:
            return
        try:
            if self.sse:
                self._feed_sse(chunk)
            elif not self._too_big:
                self._json += chunk
                self._too_big = len(self._json) > MAX_JSON_BODY
        except Exception:  # a reader must never break the stream it watches
            self.broken = True

    # ---------------------------------------------------------------- SSE

    def _feed_sse(self, chunk: bytes) -> None:
        self._buf += chunk
        if len(self._buf) > MAX_JSON_BODY:  # one unterminated line this long is not SSE
            self.broken = True
            return
        while True:
            end = self._buf.find(b"\n")
            if end < 0:
                return
            line = bytes(self._buf[:end]).rstrip(b"\r")
            del self._buf[:end + 1]
            if line.startswith(b"data:"):
                data = line[5:].lstrip(b" ")
                if data and data != b"[DONE]" and (self._wanted is None or any(w in data for w in self._wanted)):
                    self._event(json.loads(data))

    def _event(self, ev: Any) -> None:
        if not isinstance(ev, dict):
            return
        if self.api == "anthropic":
            kind = ev.get("type")
            if kind == "content_block_start" and isinstance(ev.get("content_block"), dict):
                block = dict(ev["content_block"])
                self._blocks[int(ev.get("index", len(self._blocks)))] = block
            elif kind == "content_block_delta" and isinstance(ev.get("delta"), dict):
                delta = ev["delta"]
                block = self._blocks.get(int(ev.get("index", -1)))
                if block is not None and delta.get("type") == "text_delta" and isinstance(delta.get("text"), str):
                    block["text"] = (block.get("text") or "") + delta["text"]
        elif self.api == "responses":
            kind = ev.get("type")
            if kind == "response.output_item.done" and isinstance(ev.get("item"), dict):
                self._items.append(ev["item"])
            elif kind == "response.completed" and isinstance(ev.get("response"), dict):
                output = ev["response"].get("output")
                if isinstance(output, list) and output:
                    self._completed = output
        elif self.api == "chat":
            for choice in ev.get("choices") or []:
                if isinstance(choice, dict) and choice.get("index", 0) == 0:
                    content = (choice.get("delta") or {}).get("content")
                    if isinstance(content, str):
                        self._chat.append(content)

    # ---------------------------------------------------------------- result

    def _from_json(self) -> list[TextMessage]:
        body = json.loads(bytes(self._json))
        if not isinstance(body, dict):
            return []
        if self.api == "anthropic":
            return text_messages({"messages": [{"role": "assistant", "content": body.get("content")}]}, "anthropic")
        if self.api == "responses":
            return text_messages({"input": body.get("output")}, "responses")
        choices = body.get("choices")
        if isinstance(choices, list) and choices and isinstance(choices[0], dict):
            message = choices[0].get("message")
            if isinstance(message, dict):
                return text_messages({"messages": [{"role": "assistant", "content": message.get("content")}]}, "chat")
        return []

    def result(self) -> list[TextMessage] | None:
        """The reply's assistant text messages, or None when the response could not be read."""
        if self.broken or self.api is None:
            return None
        try:
            messages = self._messages()
        except Exception:
            return None
        return None if messages is None else [m for m in messages if m.role == "assistant"]

    def _messages(self) -> list[TextMessage] | None:
        if not self.sse:
            return None if self._too_big or not self._json else self._from_json()
        if self.api == "anthropic":
            blocks = [self._blocks[i] for i in sorted(self._blocks)]
            return text_messages({"messages": [{"role": "assistant", "content": blocks}]}, "anthropic")
        if self.api == "responses":
            return text_messages({"input": self._completed or self._items}, "responses")
        return text_messages({"messages": [{"role": "assistant", "content": "".join(self._chat)}]}, "chat")
