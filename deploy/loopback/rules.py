"""Rule constructors: the Python way to script a fixture.

Every constructor takes the same matching keywords:

* ``match``: substring of the last audited user text (``regex=True``: a regular expression);
  ``None`` matches any request;
* ``times``: how many requests the rule answers (``None`` = unlimited);
* ``api``: ``"anthropic" | "responses" | "chat"`` to limit it to one API shape;
* ``kinds``: request kinds it applies to (default ``["conversation"]``);
* ``id``: a name that shows up in the recorded requests (default ``r<N>``).

Example::

    fx.add_rules(reply("pong", match="ping"), fail(529, times=1), reject(context_window=True, match="huge"))
"""

from __future__ import annotations

from typing import Any, Literal

from .models import (
    CutAction,
    FailAction,
    Kind,
    RecallAction,
    RejectAction,
    ReplyAction,
    Rule,
    StallAction,
    ToolCallAction,
)

# Candidate names of the shell tool across the five CLIs (first present in the request wins):
# Claude "Bash", Pi/OpenCode/Kilo "bash", Codex "exec_command".
SHELL_TOOLS = ("bash", "exec_command", "shell", "local_shell")


def _rule(action: Any, match: str | None, regex: bool, times: int | None,
          api: Literal["anthropic", "responses", "chat"] | None, kinds: list[Kind] | None,
          id: str | None) -> Rule:
    kw: dict[str, Any] = {"match": match, "regex": regex, "times": times, "api": api, "action": action}
    if kinds is not None:
        kw["kinds"] = kinds
    if id is not None:
        kw["id"] = id
    return Rule(**kw)


def reply(text: str, *, match: str | None = None, regex: bool = False, times: int | None = None,
          api: Literal["anthropic", "responses", "chat"] | None = None, kinds: list[Kind] | None = None,
          id: str | None = None) -> Rule:
    """Answer with exactly ``text``."""
    return _rule(ReplyAction(text=text), match, regex, times, api, kinds, id)


def recall(index: int = 0, *, prefix: str = "", match: str | None = None, regex: bool = False,
           times: int | None = None, api: Literal["anthropic", "responses", "chat"] | None = None,
           kinds: list[Kind] | None = None, id: str | None = None) -> Rule:
    """Answer with ``prefix`` + the audited user message at ``index`` of the received conversation."""
    return _rule(RecallAction(index=index, prefix=prefix), match, regex, times, api, kinds, id)


def tool_call(name: str | list[str], arguments: dict[str, Any] | str | None = None, *, shell: str | None = None,
              then_reply: str = "done", match: str | None = None, regex: bool = False, times: int | None = None,
              api: Literal["anthropic", "responses", "chat"] | None = None, kinds: list[Kind] | None = None,
              id: str | None = None) -> Rule:
    """Call tool ``name`` (case-insensitive; a list = candidates in order), then reply ``then_reply``."""
    action = ToolCallAction(name=name, arguments=arguments, shell=shell, then_reply=then_reply)
    return _rule(action, match, regex, times, api, kinds, id)


def shell_call(command: str, *, then_reply: str = "done", match: str | None = None, regex: bool = False,
               times: int | None = None, api: Literal["anthropic", "responses", "chat"] | None = None,
               kinds: list[Kind] | None = None, id: str | None = None) -> Rule:
    """Run ``command`` through whichever shell tool the request offers (Bash / bash / exec_command)."""
    return tool_call(list(SHELL_TOOLS), shell=command, then_reply=then_reply, match=match, regex=regex,
                     times=times, api=api, kinds=kinds, id=id)


def fail(status: int = 500, *, message: str | None = None, retry_after: float | None = None,
         retry_after_ms: int | None = None, match: str | None = None, regex: bool = False,
         times: int | None = None, api: Literal["anthropic", "responses", "chat"] | None = None,
         kinds: list[Kind] | None = None, id: str | None = None) -> Rule:
    """A transient HTTP error (429/500/503/529 …) with the vendor's error body."""
    action = FailAction(status=status, message=message, retry_after=retry_after, retry_after_ms=retry_after_ms)
    return _rule(action, match, regex, times, api, kinds, id)


def reject(message: str | None = None, *, context_window: bool = False, status: int = 400,
           match: str | None = None, regex: bool = False, times: int | None = None,
           api: Literal["anthropic", "responses", "chat"] | None = None, kinds: list[Kind] | None = None,
           id: str | None = None) -> Rule:
    """A terminal error (400 by default). ``context_window=True``: the vendors' context-length refusal."""
    action = RejectAction(message=message, context_window=context_window, status=status)
    return _rule(action, match, regex, times, api, kinds, id)


def context_too_long(**kw: Any) -> Rule:
    """Shorthand for ``reject(context_window=True, ...)``."""
    return reject(context_window=True, **kw)


def cut(after_deltas: int = 1, *, abort: bool = False, text: str | None = None, match: str | None = None,
        regex: bool = False, times: int | None = None, api: Literal["anthropic", "responses", "chat"] | None = None,
        kinds: list[Kind] | None = None, id: str | None = None) -> Rule:
    """Stream ``after_deltas`` deltas then stop with no final event (``abort``: drop the connection)."""
    return _rule(CutAction(after_deltas=after_deltas, abort=abort, text=text), match, regex, times, api, kinds, id)


def stall(seconds: float, *, text: str | None = None, match: str | None = None, regex: bool = False,
          times: int | None = None, api: Literal["anthropic", "responses", "chat"] | None = None,
          kinds: list[Kind] | None = None, id: str | None = None) -> Rule:
    """Send headers and the first event, wait ``seconds``, then finish the reply."""
    return _rule(StallAction(seconds=seconds, text=text), match, regex, times, api, kinds, id)
