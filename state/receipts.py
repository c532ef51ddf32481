"""Receipts: the durable record of one job (SPEC section 8 and 10)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class ContextStatus(StrEnum):
    NEW = "NEW"
    LIVE = "LIVE"
    RESTORED = "RESTORED"
    LOST = "LOST"


class Outcome(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    REFUSED = "refused"
    NOT_SETTLED = "not_settled"



class SettlementInfo(BaseModel):
    evidence: str | None = None
    is_error: bool | None = None
    detail: str | None = None
    compacted: bool = Field(default=False, description="the CLI compacted its native history during this turn "
                            "(only with CLOUD_AGENT_NATIVE_COMPACTION=on)")
    raw: list[dict[str, Any]] = Field(default_factory=list)


class SandboxInfo(BaseModel):
    container_id: str | None = None
    image_id: str | None = None
    helper_version: str | None = None


class Timings(BaseModel):
    sandbox: int = 0
    process: int = 0
    turn: int = 0
    total: int = 0


class Receipt(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str
    user_id: str
    chat_id: str
    member_id: str
    runtime: str
    context_status: ContextStatus | None
    outcome: Outcome
    reason: str | None = None
    locator_before: str | None = None
    locator_after: str | None = None
    settlement: SettlementInfo = Field(default_factory=SettlementInfo)
    assistant_text: str = ""
    sandbox: SandboxInfo = Field(default_factory=SandboxInfo)
    cli_version: str | None = None
    timings_ms: Timings = Field(default_factory=Timings)
    started_at: datetime
    finished_at: datetime
