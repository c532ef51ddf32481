"""The driver contract's data types: locators, normalized events, settlements."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr


class Locator(BaseModel):
    """A member's native resume handle.

    ``id`` is the CLI's own session id (Claude session_id, Codex thread id, Pi session id,
    OpenCode/Kilo ``ses_…``). ``path`` is set only where the CLI addresses sessions by file
    (Pi's session file); it is part of the identity, not a hint.
    """

    model_config = ConfigDict(frozen=True)

    id: str
    path: str | None = None

    def __str__(self) -> str:
        return self.id if self.path is None else f"{self.id} ({self.path})"


class MemberPaths(BaseModel):
    """Where one member's native state lives, as seen by the CLI process.

    ``home`` is private to the member (config dirs, session stores); ``workspace`` is the
    chat's working directory, shared by the chat's members and stable for the life of the
    sandbox (Claude keys transcripts by cwd; Pi stores the cwd in the session header).
    """

    model_config = ConfigDict(frozen=True)

    home: str
    workspace: str
    run_dir: str  # pidfiles and other per-process scratch


class GatewayConfig(BaseModel):
    """The model gateway the CLI talks to. One base URL serves /v1/messages,
    /v1/responses and /v1/chat/completions. In a sandbox that is the member's own prefix on
    the model socket's forwarder (``http://127.0.0.1:<port>/m/<member key>``) and ``key`` is
    the sandbox's placeholder: the host's model proxy holds the real key (SPEC 7)."""

    model_config = ConfigDict(frozen=True)

    base_url: str
    key: SecretStr  # a SecretStr all the same: host-side tests may hand a CLI a real key
    model: str


class DriverOptions(BaseModel):
    """Launch inputs the composing layer gives every driver (drivers import no pins or settings).

    ``native_compaction``: may the CLI compact its own history (``CLOUD_AGENT_NATIVE_COMPACTION``)?
    Off (default): a context-window refusal settles the turn as ``context_too_long``; no summary
    request is sent and nothing is retried with a rewritten history. On: the CLI may compact, and
    the turn's :attr:`Settlement.compacted` says when it did. ``helper_version``: the pinned
    version of the in-sandbox live bridge (images/pins), which the bridge's hello must report.
    """

    model_config = ConfigDict(frozen=True)

    native_compaction: bool = False
    helper_version: int | None = None


class FailureReason(StrEnum):
    # settled failures (the CLI says why)
    CONTEXT_TOO_LONG = "context_too_long"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    AUTH = "auth"
    API_ERROR = "api_error"
    ABORTED = "aborted"
    TRUNCATED = "truncated"
    # decided by the runner at settlement
    IDENTITY_MISMATCH = "identity_mismatch"


class NotSettledReason(StrEnum):
    TRANSPORT_CLOSED = "transport_closed"
    TIMEOUT = "timeout"
    CANCELLED = "cancelled"
    COMMAND_REJECTED = "command_rejected"
    PROTOCOL_ERROR = "protocol_error"


class HandshakeReason(StrEnum):
    NATIVE_STATE_MISSING = "native_state_missing"  # transcript / rollout / session file gone
    LOCATOR_MISMATCH = "locator_mismatch"  # the CLI resumed or reported another session
    HELPER_VERSION = "helper_version"  # the in-sandbox helper is not the pinned version
    PROCESS_FAILED = "process_failed"  # the CLI died or refused before the handshake ended
    MODEL_NOT_LISTENING = "model_not_listening"  # the launcher waited for the model endpoint in vain


class _Event(BaseModel):
    model_config = ConfigDict(frozen=True)

    raw: dict[str, Any] = Field(default_factory=dict, repr=False)


class TextDelta(_Event):
    kind: Literal["text"] = "text"
    text: str


class ToolStarted(_Event):
    kind: Literal["tool_started"] = "tool_started"
    call_id: str
    tool: str
    input: Any = None


class ToolFinished(_Event):
    kind: Literal["tool_finished"] = "tool_finished"
    call_id: str
    is_error: bool = False
    output: str | None = None


class RetryNotice(_Event):
    kind: Literal["retry"] = "retry"
    attempt: int | None = None
    status: int | None = None
    detail: str | None = None


class ErrorNotice(_Event):
    kind: Literal["error"] = "error"
    message: str
    will_retry: bool = False


class Notice(_Event):
    """Anything else worth showing (permission auto-replied, question answered, status)."""

    kind: Literal["notice"] = "notice"
    name: str
    detail: str | None = None


DriverEvent = Annotated[
    TextDelta | ToolStarted | ToolFinished | RetryNotice | ErrorNotice | Notice,
    Field(discriminator="kind"),
]


class Settlement(BaseModel):
    """The CLI's own evidence that the native turn ended (SPEC section 5)."""

    model_config = ConfigDict(frozen=True)

    evidence: str  # e.g. "claude:result", "codex:turn/completed", "pi:agent_end+get_state"
    is_error: bool
    reason: FailureReason | None = None
    detail: str | None = None
    observed_locator: Locator | None
    assistant_text: str = ""
    retire_after: bool = False  # Claude retry defect: retire the process after commit
    compacted: bool = False  # the CLI compacted its own history during this turn (native compaction on)
    raw: list[dict[str, Any]] = Field(default_factory=list)  # the settlement event(s), verbatim


class NotSettled(BaseModel):
    """The turn ended without native settlement. Nothing may be saved; retire the process."""

    model_config = ConfigDict(frozen=True)

    reason: NotSettledReason
    detail: str = ""
    assistant_text: str = ""


TurnOutcome = Settlement | NotSettled


class HandshakeFailed(Exception):
    """The native start/resume handshake did not confirm the locator: the runner's LOST."""

    def __init__(self, reason: HandshakeReason, detail: str = "", *, observed: Locator | None = None) -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail
        self.observed = observed
