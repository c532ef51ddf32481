"""Credential-free loopback model gateway for tests and the demo (SPEC 9.3).

Anthropic Messages, OpenAI Responses and OpenAI Chat Completions, streamed; a behaviour script
of rules; a recorder; and an audit that turns recorded requests into comparable histories.
"""

from .audit import (
    JOINER,
    HistoryDiff,
    annotations,
    assert_history,
    classify,
    compare_history,
    conversation,
    dialogue,
    strip_annotations,
    user_texts,
)
from .behaviour import TITLE_REPLY, default_reply, error_body, expected_default_reply, summary_reply
from .client import FixtureClient
from .models import Message, RecordedRequest, Rule, Script
from .recorder import load_jsonl, safe_headers
from .rules import context_too_long, cut, fail, recall, reject, reply, shell_call, stall, tool_call
from .server import LoopbackFixture

__all__ = [
    "JOINER", "TITLE_REPLY", "FixtureClient", "HistoryDiff", "LoopbackFixture", "Message", "RecordedRequest",
    "Rule", "Script", "annotations", "assert_history", "classify", "compare_history", "context_too_long", "conversation", "cut",
    "default_reply", "dialogue", "error_body", "expected_default_reply", "fail", "load_jsonl", "recall", "reject",
    "reply", "safe_headers", "shell_call", "stall", "strip_annotations", "summary_reply", "tool_call", "user_texts",
]
