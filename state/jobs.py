"""The job: what a host dispatches. Validated at the edge; trusted inside."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

# Ids reach container labels (hashed), SQL (parameterised) and paths (hashed); still, no
# path separators, shell metacharacters, whitespace or control characters are accepted.
ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@-]{0,127}$"
_ID = re.compile(ID_PATTERN)

Runtime = Literal["claude", "codex", "pi", "opencode", "kilo"]


def _safe_id(value: str) -> str:
    if ".." in value:
        raise ValueError("must not contain '..'")
    return value


SafeId = Annotated[str, Field(pattern=ID_PATTERN, min_length=1, max_length=128), AfterValidator(_safe_id)]


class Job(BaseModel):
    """``POST /v1/jobs`` body (SPEC section 10)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: SafeId
    user_id: SafeId
    chat_id: SafeId
    member_id: SafeId
    runtime: Runtime
    message: str = Field(min_length=1, description="passed to the CLI unchanged")
    locator: str | None = Field(default=None, min_length=1, max_length=512,
                                description="the native session id the job expects; default: the member's saved one")

    def digest(self) -> str:
        """Identity of the body for the job fence (same job_id + other body = conflict)."""
        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    new_member_id: SafeId
    at_turn: int | None = Field(default=None, ge=1, description="keep the first N settled turns; default all")


CHAT_DELETED = "chat_deleted"  # the reason on the receipt of a turn its chat's deletion cancelled


class ChatDeleted(BaseModel):
    """``DELETE /v1/users/{user_id}/chats/{chat_id}`` answer: what this deletion did. Deleting a
    deleted chat again answers the same shape with nothing left to remove."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    user_id: str
    chat_id: str
    deleted: Literal[True] = True
    cancelled_jobs: int = Field(description="running turns cancelled first (receipt reason chat_deleted)")
    retired_residents: int = Field(description="resident CLI processes retired")
    container_removed: bool
    volume_removed: bool
    records_removed: int = Field(description="sandbox, member, wire ledger and placement rows deleted")
    tombstoned_receipts: int = Field(description="receipts reduced to tombstones (no assistant text, no locators)")
