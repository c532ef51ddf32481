"""The conversation digest of one model request: ordered ``(role, sha256(text))`` (SPEC 12).

Only user and assistant *text* messages count; CLI annotations are not the user's words and
are excluded by the same rules as the regression audit (``deploy/loopback/audit.py``, the
independent witness in CI — deliberately not imported: two implementations that must agree).

The rules, per API shape:

* every shape: a text block loses each ``<system-reminder>…</system-reminder>`` block together
  with the CR/LF runs on either side of it (Claude), and a trailing
  ``<environment_details>…</environment_details>`` block with the whitespace around it (Kilo);
  a user block that is empty afterwards is dropped; the blocks left in one message are
  concatenated with no separator; assistant text is never rewritten;
* Anthropic Messages: ``system`` and mid-conversation ``role:"system"`` entries are the CLI's
  instructions; a ``tool_use`` / ``tool_result`` block ends the text message before it
  (tool traffic is not text); thinking/image blocks carry no text and split nothing;
* OpenAI Responses: developer/system items are instructions; user parts that start with one
  of Codex's context markers (``CODEX_CONTEXT_PREFIXES``) are context, not user text; a plain
  string ``input`` is one user message, taken as is;
* Chat Completions: system/developer messages are instructions; an assistant message with
  only empty text has no text message.

Known deliberate difference from the witness: the witness deletes NUL characters of a text
that also holds a system reminder (an artefact of its implementation); this one keeps them.
No CLI sends NULs in prompts.

Everything here is total: any JSON (or non-JSON) body gives a digest or ``DigestError``,
never another exception (property-tested).
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["anthropic", "responses", "chat"]
Role = Literal["user", "assistant"]

_REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>", re.DOTALL)
_ENV_OPEN, _ENV_CLOSE = "<environment_details>", "</environment_details>"
_NEWLINES = "\r\n"

# Codex sends these as user-role input parts; they are its context, not the user's words.
CODEX_CONTEXT_PREFIXES = (
    "<environment_context>",
    "<user_instructions>",
    "# AGENTS.md instructions for",
    "<turn_aborted>",
    "<user_shell_command>",
)
_TEXT_PART_TYPES = (None, "text", "input_text", "output_text")


class DigestError(ValueError):
    """The body cannot be read as a model request (the reason is safe to record)."""


@dataclass(frozen=True, slots=True)
class TextMessage:
    role: Role
    text: str

    @property
    def sha256(self) -> str:
        return sha256_text(self.text)


def sha256_text(text: str) -> str:
    # surrogatepass: a JSON body may carry lone surrogates ("\\ud800"); they still hash
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


# ---------------------------------------------------------------- annotations


def _without_reminders(text: str) -> str:
    spans = [m.span() for m in _REMINDER.finditer(text)]
    if not spans:
        return text
    pieces = []
    cursor = 0
    for i, (start, end) in enumerate(spans):
        piece = text[cursor:start]
        if i > 0:
            piece = piece.lstrip(_NEWLINES)  # the run after the previous reminder
        pieces.append(piece.rstrip(_NEWLINES))  # the run before this reminder
        cursor = end
    pieces.append(text[cursor:].lstrip(_NEWLINES))
    return "".join(pieces)


def _without_environment_details(text: str) -> str:
    first = text.find(_ENV_OPEN)
    if first < 0:
        return text
    body = text.rstrip()
    if not body.endswith(_ENV_CLOSE) or len(body) - len(_ENV_CLOSE) < first + len(_ENV_OPEN):
        return text  # not a trailing block: the user's own words
    cut = first
    while cut > 0 and text[cut - 1].isspace():
        cut -= 1
    return text[:cut]


def strip_annotations(text: str) -> str:
    """One text block without CLI annotations ('' when only annotations were there)."""
    if "<system-reminder>" in text:
        text = _without_reminders(text)
    if _ENV_OPEN in text:
        text = _without_environment_details(text)
    return text


def _user_message(blocks: Iterable[str]) -> TextMessage | None:
    kept = [t for t in map(strip_annotations, blocks) if t]
    return TextMessage("user", "".join(kept)) if kept else None


def texts_of(content: Any) -> list[str]:
    """The text parts of a message's content (a string is one part)."""
    if isinstance(content, str):
        return [content]
    if not isinstance(content, list):
        return []
    return [p["text"] for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str) and p.get("type") in _TEXT_PART_TYPES]


def items_of(value: Any) -> list[dict[str, Any]]:
    return [v for v in value if isinstance(v, dict)] if isinstance(value, list) else []


# ---------------------------------------------------------------- per shape


def _anthropic(msg: dict[str, Any]) -> Iterator[TextMessage]:
    role, content = msg.get("role"), msg.get("content")
    if role not in ("user", "assistant"):
        return
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else items_of(content)
    pending: list[str] = []
    for block in blocks:
        kind = block.get("type")
        if kind == "text" and isinstance(block.get("text"), str):
            pending.append(block["text"])
        elif kind in ("tool_use", "tool_result"):
            yield from _flush(role, pending)
            pending = []
    yield from _flush(role, pending)


def _flush(role: str, pending: list[str]) -> Iterator[TextMessage]:
    if not pending:
        return
    if role == "user":
        msg = _user_message(pending)
        if msg is not None:
            yield msg
    else:
        yield TextMessage("assistant", "".join(pending))


def _responses(item: dict[str, Any]) -> Iterator[TextMessage]:
    if item.get("type", "message") != "message":
        return
    role, texts = item.get("role"), texts_of(item.get("content"))
    if role == "user":
        msg = _user_message(t for t in texts if not t.lstrip().startswith(CODEX_CONTEXT_PREFIXES))
        if msg is not None:
            yield msg
    elif role == "assistant" and texts:
        yield TextMessage("assistant", "".join(texts))


def _chat(msg: dict[str, Any]) -> Iterator[TextMessage]:
    role = msg.get("role")
    if role == "user":
        user = _user_message(texts_of(msg.get("content")))
        if user is not None:
            yield user
    elif role == "assistant":
        texts = [t for t in texts_of(msg.get("content")) if t]
        if texts:
            yield TextMessage("assistant", "".join(texts))


_ITEM_SHAPES = {"anthropic": _anthropic, "responses": _responses, "chat": _chat}


def conversation_items(body: Any, api: str) -> list[dict[str, Any]] | str | None:
    """The request's conversation as its shape carries it: its message objects in order, a
    plain string (a Responses ``input``: one user message), or None (no such shape)."""
    if not isinstance(body, dict) or api not in _ITEM_SHAPES:
        return None
    value = body.get("input" if api == "responses" else "messages")
    if api == "responses" and isinstance(value, str):
        return value
    return items_of(value)


def item_messages(item: dict[str, Any], api: str) -> list[TextMessage]:
    """The text messages of one conversation item: each depends on its item alone."""
    return list(_ITEM_SHAPES[api](item))


def text_messages(body: Any, api: str) -> list[TextMessage]:
    """The user/assistant text messages of a parsed request body, in order."""
    items = conversation_items(body, api)
    if isinstance(items, str):
        return [TextMessage("user", items)]
    return [m for item in items or [] for m in _ITEM_SHAPES[api](item)]


# ---------------------------------------------------------------- raw bodies


def decode_body(raw: bytes, content_encoding: str | None = None, *, limit: int = 64 << 20) -> Any:
    """Parse a raw request body (gzip/deflate undone) as JSON; ``DigestError`` otherwise."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("gzip", "x-gzip", "deflate"):
        try:
            inflater = zlib.decompressobj(47)  # 47: gzip or zlib header, auto-detected
            raw = inflater.decompress(raw, limit)
            if inflater.unconsumed_tail:
                raise DigestError(f"decompressed body is larger than {limit} bytes")
        except zlib.error as exc:
            raise DigestError(f"body is not valid {encoding}: {exc}") from None
    elif encoding != "identity":
        raise DigestError(f"content-encoding {encoding!r} is not audited")
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise DigestError(f"body is not JSON: {exc.__class__.__name__}") from None
