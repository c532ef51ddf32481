"""Receipts: the durable record of one job (SPEC section 8 and 10)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

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
    volume: str | None = Field(default=None, description="the chat's state volume (SPEC 15)")
    recreated: bool = Field(default=False, description="the member's native state was last verified in another "
                            "container: this one was created on the same volume since (container lost, image "
                            "upgraded or sandbox migrated); the resume handshake confirmed the locator")


class UpgradedFrom(BaseModel):
    """The image (and CLI version) the member's native state was last verified on (SPEC 15)."""

    image_id: str
    cli_version: str | None = Field(default=None, description="unknown for turns settled before state volumes")


class Timings(BaseModel):
    sandbox: int = 0
    process: int = 0
    turn: int = 0
    total: int = 0


class WireDifference(BaseModel):
    """The first place the turn's request differs from what the model saw before (digests only)."""

    index: int = Field(description="position in the request's conversation (user/assistant texts)")
    role: Literal["user", "assistant"]
    expected_digest: str | None = Field(default=None, description="sha256 of the expected text")
    observed_digest: str | None = Field(default=None, description="sha256 of the text sent; None: the request "
                                        "ends before this index")


class WireInfo(BaseModel):
    """The wire verdict of the turn (SPEC 12): did the model see the member's history?"""

    requests: int = Field(description="model requests of the turn the proxy forwarded")
    side_requests: int = Field(description="of those, side requests (preconnect, title, summary, …)")
    history: Literal["new", "complete", "gap", "compacted", "none"]
    first_difference: WireDifference | None = None


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
    upgraded_from: UpgradedFrom | None = Field(
        default=None, description="set when the member's native state was last verified on another image: this "
        "turn resumed it through the current image's CLI")
    timings_ms: Timings = Field(default_factory=Timings)
    wire: WireInfo | None = Field(default=None, description="the wire verdict; None on receipts written before "
                                  "the model proxy audited turns")
    started_at: datetime
    finished_at: datetime
    deleted_at: datetime | None = Field(default=None, description="set on the tombstone a deleted chat keeps of "
                                        "its receipts: ids, statuses, outcomes, timings; no text, no locator")


def tombstone(receipt_json: str, deleted_at: datetime) -> str:
    """What a deleted chat keeps of one receipt (SPEC 10): ids, statuses, outcomes, timings.

    Everything that carries conversation text or a native handle goes: the assistant text,
    the settlement's detail and raw events (Claude's ``result`` event repeats the reply), the
    locators (their native sessions are destroyed) and the wire verdict's digests (a digest
    of a short text is as good as the text).
    """
    r = Receipt.model_validate_json(receipt_json)
    settlement = SettlementInfo(evidence=r.settlement.evidence, is_error=r.settlement.is_error,
                                compacted=r.settlement.compacted)
    wire = None if r.wire is None else WireInfo(requests=r.wire.requests, side_requests=r.wire.side_requests,
                                                history=r.wire.history)
    return r.model_copy(update={"assistant_text": "", "locator_before": None, "locator_after": None,
                                "settlement": settlement, "wire": wire, "deleted_at": deleted_at}).model_dump_json()
