"""Which model requests are the member's conversation and which are side requests (SPEC 9.1, 12).

A CLI's main loop carries the member's conversation; everything else is a side request the
wire verdict must not compare: preconnect probes (``HEAD``), title generation, compaction
summaries, Claude subagents, model listings and token counts. The markers are the ones the
pinned CLIs were measured to send (shared/protocols: opencode-kilo.md §3 for titles; the
summary prompts of pi, Claude, OpenCode and Codex; Claude's subagent system prompt) — the same
rules as the regression audit, so both witnesses sort requests alike.
"""

from __future__ import annotations

from typing import Any, Literal

from .digest import items_of, texts_of

Kind = Literal["conversation", "title", "summary", "subagent", "probe", "models", "count_tokens", "other"]

TITLE_MARKERS = ("Generate a title for this conversation", "You are a title generator")
SUMMARY_MARKERS = (
    "You are a context summarization assistant",  # pi
    "You are a helpful AI assistant tasked with summarizing conversations",  # Claude, OpenCode
    "Your task is to create a detailed summary of the conversation so far",  # Claude /compact
    "CONTEXT CHECKPOINT COMPACTION",  # Codex
    "Provide a detailed prompt for continuing our conversation above",  # OpenCode
)
SUBAGENT_MARKERS = ("You are an agent for Claude Code", "cc_is_subagent=true")


def _instructions(body: dict[str, Any], api: str) -> str:
    """The CLI's own instructions: system prompts and system/developer messages."""
    parts: list[str] = []
    if api == "anthropic":
        if "system" in body:
            parts += texts_of(body["system"])
        parts += [t for m in items_of(body.get("messages")) if m.get("role") == "system"
                  for t in texts_of(m.get("content"))]
    elif api == "responses":
        if isinstance(body.get("instructions"), str):
            parts.append(body["instructions"])
        parts += [t for m in items_of(body.get("input")) if m.get("role") in ("developer", "system")
                  for t in texts_of(m.get("content"))]
    elif api == "chat":
        parts += [t for m in items_of(body.get("messages")) if m.get("role") in ("system", "developer")
                  for t in texts_of(m.get("content"))]
    return "\n".join(parts)


def _raw_user_text(body: dict[str, Any], api: str) -> str:
    """All user-role text with annotations kept: side-request prompts live there too."""
    value = body.get("input" if api == "responses" else "messages")
    if isinstance(value, str):
        return value
    return "\n".join(t for m in items_of(value) if m.get("role") == "user" for t in texts_of(m.get("content")))


def classify(body: Any, api: str | None) -> Kind:
    """The kind of a POSTed model request of shape ``api`` (``other`` when unreadable)."""
    if api not in ("anthropic", "responses", "chat") or not isinstance(body, dict):
        return "other"
    conversation = body.get("input" if api == "responses" else "messages")
    if not (isinstance(conversation, list) or (api == "responses" and isinstance(conversation, str))):
        return "other"  # no conversation to carry: the gateway rejects it (the fixture answers 400)
    instructions, users = _instructions(body, api), _raw_user_text(body, api)

    def carries(markers: tuple[str, ...]) -> bool:
        return any(m in instructions or m in users for m in markers)

    if not body.get("tools") and carries(TITLE_MARKERS):
        return "title"
    if carries(SUMMARY_MARKERS):
        return "summary"
    if api == "anthropic" and any(m in instructions for m in SUBAGENT_MARKERS):
        return "subagent"
    return "conversation"
