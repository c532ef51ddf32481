"""Data models of the loopback fixture: audited messages, rules (the behaviour script), records.

Everything here is plain pydantic so a script can be written as JSON (``--script FILE.json``,
``POST /_fixture/rules``) and the same objects are built from Python with the constructors in
``rules.py``.
"""

from __future__ import annotations

import itertools
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

Api = Literal["anthropic", "responses", "chat", "head", "other"]
# Request kinds: ``conversation`` is the CLI's main loop; everything else is a side request
# that history regressions must tell apart (SPEC 9.1).
Kind = Literal["conversation", "title", "subagent", "summary", "probe", "other"]
Role = Literal["user", "assistant", "tool_call", "tool_result"]


class Message(BaseModel):
    """One entry of an audited conversation.

    Equality is on every field; history comparisons use ``role`` and ``text`` only (see
    ``audit.compare_history``). For ``tool_call`` the text is the raw arguments JSON and ``name``
    the tool; for ``tool_result`` the text is the result flattened to a string.
    """

    model_config = ConfigDict(frozen=True)

    role: Role
    text: str
    name: str | None = None
    call_id: str | None = None

    @classmethod
    def user(cls, text: str) -> Message:
        return cls(role="user", text=text)

    @classmethod
    def assistant(cls, text: str) -> Message:
        return cls(role="assistant", text=text)

    def __str__(self) -> str:
        extra = f" {self.name}" if self.name else ""
        return f"{self.role}{extra}: {self.text!r}"


# ---------------------------------------------------------------- actions (what a rule does)


class ReplyAction(BaseModel):
    type: Literal["reply"] = "reply"
    text: str


class RecallAction(BaseModel):
    """Answer with the audited user message at ``index`` (negative counts from the end)."""

    type: Literal["recall"] = "recall"
    index: int = 0
    prefix: str = ""


class ToolCallAction(BaseModel):
    """Return a tool call in the request's API shape; answer the follow-up with ``then_reply``.

    ``name`` (or each of a list of candidates, in order) is matched case-insensitively against
    the request's tools; the first match wins and its exact spelling is used. ``arguments`` may be a dict or a JSON string. ``shell`` instead of
    ``arguments`` builds the arguments from the matched tool's schema: the command goes into
    ``command`` or ``cmd`` (Codex ``exec_command``), and a required ``description`` is filled.
    """

    type: Literal["tool_call"] = "tool_call"
    name: str | list[str]
    arguments: dict[str, Any] | str | None = None
    shell: str | None = None
    then_reply: str = "done"


class FailAction(BaseModel):
    """A transient error: vendor error body, optional Retry-After / retry-after-ms headers."""

    type: Literal["fail"] = "fail"
    status: int = 500
    message: str | None = None
    retry_after: float | None = None
    retry_after_ms: int | None = None


class RejectAction(BaseModel):
    """A terminal 400. ``context_window`` uses the vendors' real context-length wording."""

    type: Literal["reject"] = "reject"
    message: str | None = None
    context_window: bool = False
    status: int = 400


class CutAction(BaseModel):
    """Stream part of the reply then stop without the final event.

    ``abort=False`` ends the HTTP body cleanly (a truncated but well-formed stream);
    ``abort=True`` drops the connection mid-body (the client sees a transport error).
    """

    type: Literal["cut"] = "cut"
    after_deltas: int = 1
    abort: bool = False
    text: str | None = None


class StallAction(BaseModel):
    """Send headers and the first event, wait ``seconds``, then finish the reply normally."""

    type: Literal["stall"] = "stall"
    seconds: float
    text: str | None = None


Action = Annotated[
    ReplyAction | RecallAction | ToolCallAction | FailAction | RejectAction | CutAction | StallAction,
    Field(discriminator="type"),
]

_rule_ids = itertools.count(1)


class Rule(BaseModel):
    """Match on the last audited user text of a request, then act.

    ``match`` is a substring (or a regex with ``regex=True``); ``None`` matches every request of
    the selected kinds. ``times`` is the remaining budget (``None`` = unlimited); it is spent by
    each request the rule answers. ``api`` limits the rule to one API shape. Rules only see
    requests of ``kinds`` (default: conversation requests, so a title request that quotes the
    user text does not trip a rule), and never the follow-up that carries a scripted tool
    call's result (that one gets the tool call's ``then_reply``).
    """

    id: str = Field(default_factory=lambda: f"r{next(_rule_ids)}")
    match: str | None = None
    regex: bool = False
    api: Literal["anthropic", "responses", "chat"] | None = None
    kinds: list[Kind] = Field(default_factory=lambda: ["conversation"])
    times: int | None = None
    action: Action

    def matches(self, text: str, api: str, kind: str) -> bool:
        if self.times is not None and self.times <= 0:
            return False
        if self.api is not None and self.api != api:
            return False
        if kind not in self.kinds:
            return False
        if self.match is None:
            return True
        if self.regex:
            return re.search(self.match, text) is not None
        return self.match in text


class Script(BaseModel):
    """A fixture's behaviour script: ordered rules, first match wins."""

    rules: list[Rule] = Field(default_factory=list)


# ---------------------------------------------------------------- recorder entries


class RecordedRequest(BaseModel):
    """One request as the fixture saw it. Auth headers are removed before it is built."""

    seq: int
    time: float
    method: str
    path: str
    query: str = ""
    api: Api
    kind: Kind
    headers: dict[str, str] = Field(default_factory=dict)
    credentials: dict[str, str] = Field(default_factory=dict)  # auth header -> fingerprint, never the value
    body: Any = None
    raw: str | None = None  # the body text when it was not JSON
    status: int = 0
    reply_text: str | None = None
    tool_call: dict[str, Any] | None = None
    rule: str | None = None
    action: str | None = None  # reply | recall | tool_call | tool_followup | fail | reject | cut | stall | default | side | error
    error: str | None = None  # why a request was refused (malformed)

    def conversation(self) -> list[Message]:
        from .audit import conversation

        return conversation(self.body, self.api) if isinstance(self.body, dict) else []

    def dialogue(self) -> list[Message]:
        from .audit import dialogue

        return dialogue(self.conversation())
