"""Audit: turn a recorded model request into the conversation it carries, and compare histories.

Pure functions, no server. The three API shapes (Anthropic Messages, OpenAI Responses, OpenAI
Chat Completions) all become one ordered list of ``Message`` entries: ``user`` / ``assistant``
text plus separate ``tool_call`` / ``tool_result`` entries.

CLI-generated annotations are not user text (SPEC 9.1) and are stripped:

* Claude: ``<system-reminder>…</system-reminder>`` blocks (whole blocks or embedded), ``system``
  entries inside ``messages[]``, the top-level system prompt;
* Codex: developer/system messages, ``<environment_context>``, ``<user_instructions>`` and
  ``# AGENTS.md instructions`` user messages, ``<turn_aborted>`` markers;
* Chat: system/developer messages; Kilo's ``<environment_details>`` part or suffix.

Joiner: the text blocks that remain in one message are concatenated exactly (``JOINER`` is
the empty string). Claude Code merges a failed user message into the next one as two blocks
and ends the first with "\n" itself (observed on 2.1.220: ``["FAILME please\n", "after
failure"]``), so the audited text is ``failed + "\n" + next``, the same text Claude builds
when it coalesces queued input. A message that is a single block round-trips byte for byte
(no whitespace is trimmed).
"""

from __future__ import annotations

import difflib
import json
import re
from collections import Counter
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, Field

from .models import Kind, Message

JOINER = ""

_REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>", re.DOTALL)
# Kilo appends "\n\n<environment_details>…</environment_details>" (a second part, or a suffix).
_ENV_DETAILS = re.compile(r"\s*<environment_details>.*?</environment_details>\s*\Z", re.DOTALL)
# Codex injects these as user-role messages; they are context, not the user's words.
_CODEX_CONTEXT_PREFIXES = (
    "<environment_context>",
    "<user_instructions>",
    "# AGENTS.md instructions for",
    "<turn_aborted>",
    "<user_shell_command>",
)

TITLE_MARKERS = ("Generate a title for this conversation", "You are a title generator")
SUMMARY_MARKERS = (
    "You are a context summarization assistant",  # pi
    "You are a helpful AI assistant tasked with summarizing conversations",  # Claude / OpenCode
    "Your task is to create a detailed summary of the conversation so far",  # Claude /compact
    "CONTEXT CHECKPOINT COMPACTION",  # Codex
    "Provide a detailed prompt for continuing our conversation above",  # OpenCode
)
SUBAGENT_MARKERS = ("You are an agent for Claude Code", "cc_is_subagent=true")


# ---------------------------------------------------------------- annotation stripping


def strip_annotations(text: str) -> str:
    """Remove CLI annotations from one text block; '' when nothing but annotations remains.

    An embedded reminder takes the blank lines that separate it from the user's text with it,
    so ``"<system-reminder>…</system-reminder>\\n\\nhello"`` audits as ``"hello"``. Text without
    annotations is returned unchanged.
    """
    out = text
    if "<system-reminder>" in out:
        out = _REMINDER.sub("\x00", out)
        # drop the separator newlines that sat between a reminder and the real text
        out = re.sub(r"\x00[\r\n]*", "\x00", out)
        out = re.sub(r"[\r\n]*\x00", "\x00", out)
        out = out.replace("\x00", "")
    if "<environment_details>" in out:
        out = _ENV_DETAILS.sub("", out)
    return out


def _is_codex_context(text: str) -> bool:
    return text.lstrip().startswith(_CODEX_CONTEXT_PREFIXES)


def _flatten(content: Any) -> str:
    """Any tool-result content (string, list of blocks, object) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for block in content:
            if isinstance(block, dict) and isinstance(block.get("text"), str):
                parts.append(block["text"])
            elif isinstance(block, str):
                parts.append(block)
            else:
                parts.append(json.dumps(block, sort_keys=True))
        return "\n".join(parts)
    return json.dumps(content, sort_keys=True)


def _user_texts(blocks: Iterable[str]) -> str | None:
    """Join the non-annotation text blocks of one user message; None when none remains."""
    kept = [t for t in (strip_annotations(b) for b in blocks) if t != ""]
    return JOINER.join(kept) if kept else None


# ---------------------------------------------------------------- per-shape conversations


def _flush_text(out: list[Message], role: str, pending: list[str]) -> None:
    """Emit the text blocks collected for one message (user text is audited), then reset."""
    if not pending:
        return
    if role == "user":
        text = _user_texts(pending)
        if text is not None:
            out.append(Message(role="user", text=text))
    else:
        out.append(Message(role="assistant", text=JOINER.join(pending)))
    pending.clear()


def _anthropic(body: dict[str, Any]) -> list[Message]:
    out: list[Message] = []
    for msg in body.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        role, content = msg.get("role"), msg.get("content")
        if role not in ("user", "assistant"):
            continue  # Claude puts role:"system" entries mid-conversation
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else (content or [])
        pending: list[str] = []
        for block in blocks:
            if not isinstance(block, dict):
                continue
            btype = block.get("type")
            if btype == "text" and isinstance(block.get("text"), str):
                pending.append(block["text"])
            elif btype == "tool_use":
                _flush_text(out, role, pending)
                args = json.dumps(block.get("input") or {}, sort_keys=True)
                out.append(Message(role="tool_call", text=args, name=block.get("name"), call_id=block.get("id")))
            elif btype == "tool_result":
                _flush_text(out, role, pending)
                out.append(Message(role="tool_result", text=_flatten(block.get("content")),
                                   call_id=block.get("tool_use_id")))
            # thinking / image / document blocks carry no history text
        _flush_text(out, role, pending)
    return out


def _content_texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    texts = []
    for part in content or []:
        if isinstance(part, dict) and isinstance(part.get("text"), str) and part.get("type") in (
            None, "text", "input_text", "output_text",
        ):
            texts.append(part["text"])
    return texts


def _responses(body: dict[str, Any]) -> list[Message]:
    items = body.get("input")
    if isinstance(items, str):
        return [Message(role="user", text=items)]
    out: list[Message] = []
    for item in items or []:
        if not isinstance(item, dict):
            continue
        itype = item.get("type", "message")
        if itype == "message":
            role = item.get("role")
            texts = _content_texts(item.get("content"))
            if role == "user":
                texts = [t for t in texts if not _is_codex_context(t)]
                text = _user_texts(texts)
                if text is not None:
                    out.append(Message(role="user", text=text))
            elif role == "assistant" and texts:
                out.append(Message(role="assistant", text=JOINER.join(texts)))
            # developer / system messages are the CLI's instructions
        elif itype in ("function_call", "custom_tool_call"):
            args = item.get("arguments", item.get("input", ""))
            out.append(Message(role="tool_call", text=args if isinstance(args, str) else json.dumps(args),
                               name=item.get("name"), call_id=item.get("call_id")))
        elif itype in ("function_call_output", "custom_tool_call_output"):
            out.append(Message(role="tool_result", text=_flatten(item.get("output")), call_id=item.get("call_id")))
    return out


def _chat(body: dict[str, Any]) -> list[Message]:
    out: list[Message] = []
    for msg in body.get("messages") or []:
        if not isinstance(msg, dict):
            continue
        role = msg.get("role")
        if role == "user":
            text = _user_texts(_content_texts(msg.get("content")))
            if text is not None:
                out.append(Message(role="user", text=text))
        elif role == "assistant":
            texts = [t for t in _content_texts(msg.get("content")) if t != ""]
            if texts:
                out.append(Message(role="assistant", text=JOINER.join(texts)))
            for call in msg.get("tool_calls") or []:
                fn = call.get("function") or {}
                out.append(Message(role="tool_call", text=fn.get("arguments") or "", name=fn.get("name"),
                                   call_id=call.get("id")))
        elif role == "tool":
            out.append(Message(role="tool_result", text=_flatten(msg.get("content")), call_id=msg.get("tool_call_id")))
    return out


def conversation(body: dict[str, Any] | None, api: str) -> list[Message]:
    """The audited conversation of one request body of API shape ``api``."""
    if not isinstance(body, dict):
        return []
    if api == "anthropic":
        return _anthropic(body)
    if api == "responses":
        return _responses(body)
    if api == "chat":
        return _chat(body)
    return []


def annotations(body: dict[str, Any] | None, api: str) -> list[str]:
    """The user-role text :func:`conversation` strips as CLI annotations, in request order: each
    ``<system-reminder>`` block, ``<environment_details>`` suffix and Codex context message.

    What the audit does not compare must still be accounted for: SPEC 9.1's "the supervisor adds
    nothing" check matches every piece against the annotations each pinned CLI is known to add.
    """
    if not isinstance(body, dict):
        return []
    items = body.get("input" if api == "responses" else "messages")
    if not isinstance(items, list):
        return []
    out: list[str] = []
    for msg in items:
        if not isinstance(msg, dict) or msg.get("role") != "user" or msg.get("type", "message") != "message":
            continue
        for text in _content_texts(msg.get("content")):
            if api == "responses" and _is_codex_context(text):
                out.append(text)
                continue
            out.extend(_REMINDER.findall(text))
            details = _ENV_DETAILS.search(_REMINDER.sub("", text)) if "<environment_details>" in text else None
            if details is not None:
                out.append(details.group(0))
    return out


def dialogue(messages: Iterable[Message]) -> list[Message]:
    """Only the user and assistant entries (what history regressions compare)."""
    return [m for m in messages if m.role in ("user", "assistant")]


def user_texts(messages: Iterable[Message]) -> list[str]:
    return [m.text for m in messages if m.role == "user"]


# ---------------------------------------------------------------- classification


def _system_text(body: dict[str, Any], api: str) -> str:
    parts: list[str] = []
    if api == "anthropic":
        system = body.get("system")
        parts.extend(_content_texts(system) if system is not None else [])
        for msg in body.get("messages") or []:
            if isinstance(msg, dict) and msg.get("role") == "system":
                parts.extend(_content_texts(msg.get("content")))
    elif api == "responses":
        if isinstance(body.get("instructions"), str):
            parts.append(body["instructions"])
        for item in body.get("input") or []:
            if isinstance(item, dict) and item.get("role") in ("developer", "system"):
                parts.extend(_content_texts(item.get("content")))
    elif api == "chat":
        for msg in body.get("messages") or []:
            if isinstance(msg, dict) and msg.get("role") in ("system", "developer"):
                parts.extend(_content_texts(msg.get("content")))
    return "\n".join(parts)


def _raw_user_text(body: dict[str, Any], api: str) -> str:
    """All user-role text, annotations included (side-request prompts live there)."""
    key = "input" if api == "responses" else "messages"
    items = body.get(key)
    if isinstance(items, str):
        return items
    parts: list[str] = []
    for msg in items or []:
        if isinstance(msg, dict) and msg.get("role") == "user":
            parts.extend(_content_texts(msg.get("content")))
    return "\n".join(parts)


def classify(body: Any, api: str, method: str = "POST") -> Kind:
    """``conversation`` or the kind of side request: title, subagent, summary, probe, other."""
    if method == "HEAD" or api == "head":
        return "probe"
    if api not in ("anthropic", "responses", "chat") or not isinstance(body, dict):
        return "other"
    system = _system_text(body, api)
    users = _raw_user_text(body, api)
    if not body.get("tools") and any(m in system or m in users for m in TITLE_MARKERS):
        return "title"
    if any(system.lstrip().startswith(m) or m in users or m in system for m in SUMMARY_MARKERS):
        return "summary"
    if api == "anthropic" and any(m in system for m in SUBAGENT_MARKERS):
        return "subagent"
    return "conversation"


# ---------------------------------------------------------------- history comparison


class Difference(BaseModel):
    """One difference between an expected and an observed history."""

    kind: str  # missing | extra | reordered | changed | count
    message: Message | None = None
    observed: Message | None = None
    expected_index: int | None = None
    observed_index: int | None = None
    expected_count: int | None = None
    observed_count: int | None = None

    def describe(self) -> str:
        if self.kind == "missing":
            return f"missing  expected[{self.expected_index}] {self.message}"
        if self.kind == "extra":
            return f"extra    observed[{self.observed_index}] {self.message}"
        if self.kind == "reordered":
            return (f"reordered {self.message}: expected at [{self.expected_index}], "
                    f"observed at [{self.observed_index}]")
        if self.kind == "changed":
            assert self.message is not None and self.observed is not None
            return (f"changed  expected[{self.expected_index}] vs observed[{self.observed_index}] "
                    f"({self.message.role}): {_text_diff(self.message.text, self.observed.text)}")
        return (f"count    {self.message}: expected {self.expected_count} occurrence(s), "
                f"observed {self.observed_count}")


def _text_diff(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    lo = max(0, i - 20)
    return (f"first difference at char {i}: expected …{a[lo:i + 30]!r}… "
            f"observed …{b[lo:i + 30]!r}… (lengths {len(a)} vs {len(b)})")


class HistoryDiff(BaseModel):
    expected: list[Message] = Field(default_factory=list)
    observed: list[Message] = Field(default_factory=list)
    differences: list[Difference] = Field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.differences

    def __bool__(self) -> bool:  # truthy when the histories match
        return self.ok

    def __str__(self) -> str:
        if self.ok:
            return f"history OK ({len(self.observed)} messages)"
        lines = [f"history differs: {len(self.differences)} difference(s)"]
        lines += ["  " + d.describe() for d in self.differences]
        lines.append("expected:")
        lines += [f"  [{i}] {m}" for i, m in enumerate(self.expected)]
        lines.append("observed:")
        lines += [f"  [{i}] {m}" for i, m in enumerate(self.observed)]
        return "\n".join(lines)


def _key(m: Message) -> tuple[str, str]:
    return (m.role, m.text)


def compare_history(
    expected: list[Message], observed: list[Message], *, roles: tuple[str, ...] = ("user", "assistant")
) -> HistoryDiff:
    """Exact comparison of two histories over ``roles`` (default: user and assistant).

    Reports, in this order: occurrence-count mismatches, messages present in both but in a
    different order, changed text (same position and role, different text), then what is
    missing from ``observed`` or extra in it.
    """
    exp = [m for m in expected if m.role in roles]
    obs = [m for m in observed if m.role in roles]
    diff = HistoryDiff(expected=exp, observed=obs)
    if [_key(m) for m in exp] == [_key(m) for m in obs]:
        return diff
    diffs: list[Difference] = []
    ce, co = Counter(map(_key, exp)), Counter(map(_key, obs))
    by_key = {_key(m): m for m in exp + obs}
    for key in dict.fromkeys([_key(m) for m in exp + obs]):  # first-appearance order
        if ce[key] and co[key] and ce[key] != co[key]:
            diffs.append(Difference(kind="count", message=by_key[key], expected_count=ce[key], observed_count=co[key]))

    matcher = difflib.SequenceMatcher(a=[_key(m) for m in exp], b=[_key(m) for m in obs], autojunk=False)
    missing: list[tuple[int, Message]] = []
    extra: list[tuple[int, Message]] = []
    changed: list[tuple[int, int]] = []
    for op, a0, a1, b0, b1 in matcher.get_opcodes():
        if op == "equal":
            continue
        if op == "replace":
            pairs = min(a1 - a0, b1 - b0)
            for k in range(pairs):
                if exp[a0 + k].role == obs[b0 + k].role and _key(exp[a0 + k]) not in co and _key(obs[b0 + k]) not in ce:
                    changed.append((a0 + k, b0 + k))
                else:
                    missing.append((a0 + k, exp[a0 + k]))
                    extra.append((b0 + k, obs[b0 + k]))
            missing += [(i, exp[i]) for i in range(a0 + pairs, a1)]
            extra += [(j, obs[j]) for j in range(b0 + pairs, b1)]
        elif op == "delete":
            missing += [(i, exp[i]) for i in range(a0, a1)]
        elif op == "insert":
            extra += [(j, obs[j]) for j in range(b0, b1)]

    # A message both "missing" here and "extra" there moved: report it once, as reordered.
    for mi, (i, m) in list(enumerate(missing)):
        for ei, (j, o) in enumerate(extra):
            if o is not None and _key(o) == _key(m):
                diffs.append(Difference(kind="reordered", message=m, expected_index=i, observed_index=j))
                missing[mi] = (i, None)  # type: ignore[assignment]
                extra[ei] = (j, None)  # type: ignore[assignment]
                break
    for i, j in changed:
        diffs.append(Difference(kind="changed", message=exp[i], observed=obs[j], expected_index=i, observed_index=j))
    diffs += [Difference(kind="missing", message=m, expected_index=i) for i, m in missing if m is not None]
    diffs += [Difference(kind="extra", message=o, observed_index=j) for j, o in extra if o is not None]
    diff.differences = diffs
    return diff


def assert_history(expected: list[Message], observed: list[Message], **kw: Any) -> HistoryDiff:
    """``compare_history`` that raises ``AssertionError(str(diff))`` on any difference."""
    diff = compare_history(expected, observed, **kw)
    if not diff.ok:
        raise AssertionError(str(diff))
    return diff
