"""What one turn carries through the state machine, its refusals and its receipt."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from drivers.models import Locator, Settlement
from images.pins import cli_version_from_labels, load_pins
from runner.residents import Resident, ResidentPool
from sandbox_manager.sandbox import Sandbox
from state.jobs import Job
from state.receipts import ContextStatus, Outcome, Receipt, SandboxInfo, SettlementInfo, Timings, UpgradedFrom
from state.records import MemberRecord, SandboxState, SavedLocator
from state.sandbox_writes import SeenSandbox
from state.store import Store
from telemetry.turn_trace import mark

Emit = Callable[[dict[str, Any]], None]
LaunchGate = Callable[[tuple[str, str, str], str], AbstractAsyncContextManager[None]]
# (member, runtime) -> returns once a turn on the member's resident has room to grow (the memory budget)
TurnGate = Callable[[tuple[str, str, str], str], Awaitable[None]]


@dataclass(frozen=True)
class KnownMember:
    """The member's record read before the turn took the member's lock, still current under it
    (runner.member_locks.Sighting); ``record`` None: the member has none yet."""

    record: MemberRecord | None


def to_locator(saved: SavedLocator | None) -> Locator | None:
    return None if saved is None else Locator(id=saved.id, path=saved.path)


def to_saved(loc: Locator) -> SavedLocator:
    return SavedLocator(id=loc.id, path=loc.path)


def is_new(member: MemberRecord) -> bool:
    """NEW: no native turn of this member's own session has settled (a lazy fork's session
    comes into being at its first turn, whatever history it inherits)."""
    return member.settled_turns == 0 or member.pending_fork is not None


def serves(resident: Resident, saved: SavedLocator | None, container_id: str) -> bool:
    """LIVE: the resident process is alive, on the saved locator, in the chat's container."""
    return (resident.alive and saved is not None and resident.locator is not None
            and resident.locator.id == saved.id and resident.container_id == container_id)


class Refusal(Exception):
    """Execution refused before any message reached a CLI.

    ``sticky``: the member's native state is lost for good (a LOST member stays LOST); a job
    that merely names the wrong locator is refused without condemning the member.
    """

    def __init__(self, reason: str, status: ContextStatus | None = ContextStatus.LOST, *, sticky: bool = True,
                 detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail
        self.status = status
        self.sticky = sticky and status == ContextStatus.LOST


@dataclass
class TurnContext:
    job: Job
    emit: Emit
    started_at: datetime = field(default_factory=lambda: datetime.now(UTC))
    t0: float = field(default_factory=time.monotonic)
    timings: Timings = field(default_factory=Timings)
    status: ContextStatus | None = None
    sandbox: Sandbox | None = None
    seen_sandbox: SeenSandbox | None = None  # the chat's sandbox record as the job's claim read it
    member: MemberRecord | None = None
    cli_version: str | None = None
    compacted: bool = False  # the driver saw the CLI's own compaction in this turn
    # SPEC 15: the member's native state was last verified in another container / on another image
    recreated: bool = False
    upgraded_from: UpgradedFrom | None = None
    # Work that runs beside the turn's preparation but is done before the CLI gets the message:
    # the job's claim on disk (runner.claim_on_disk) and the proxy knowing the member's requests
    # belong to this job (awaited before the settle's flush too: the end follows the begin)
    claim_on_disk: Callable[[], Awaitable[None]] | None = None
    proxy_begun: Callable[[], Awaitable[None]] | None = None
    input_ns: int | None = None  # wall clock just before the CLI's turn began (its message not yet written)

    def ms_since(self, t: float) -> int:
        return int((time.monotonic() - t) * 1000)



class Detached(Exception):
    """The daemon is shutting down under a turn that runs on under its keeper (SPEC 14)."""


class InputNotReady(Exception):
    """What the CLI's input waits for failed (the claim's flush, the proxy's begin): raised from
    inside the driver's turn before anything was sent, and re-raised past it as ``cause``."""

    def __init__(self, cause: Exception) -> None:
        super().__init__(str(cause))
        self.cause = cause


class NotStarted(Exception):
    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.detail = detail


def build_receipt(ctx: TurnContext, outcome: Outcome, *, reason: str | None = None,
                  settlement: Settlement | None = None, text: str = "", locator_after: str | None = None,
                  detail: str | None = None) -> Receipt:
    """The turn's receipt from what the turn knows so far (its total time ends here)."""
    job = ctx.job
    ctx.timings.total = ctx.ms_since(ctx.t0)
    sb = ctx.sandbox
    cli_version = ctx.cli_version or (cli_version_from_labels(sb.image.labels, job.runtime) if sb else None)
    info = SettlementInfo()
    if settlement is not None:
        info = SettlementInfo(evidence=settlement.evidence, is_error=settlement.is_error,
                              compacted=settlement.compacted,
                              detail=settlement.detail, raw=settlement.raw)
    elif detail:
        info = SettlementInfo(detail=detail)
    before = ctx.member.locator.id if ctx.member and ctx.member.locator else None
    receipt = Receipt(
        job_id=job.job_id, user_id=job.user_id, chat_id=job.chat_id, member_id=job.member_id,
        runtime=job.runtime, context_status=ctx.status, outcome=outcome, reason=reason,
        locator_before=before, locator_after=locator_after if locator_after is not None else before,
        settlement=info, assistant_text=text,
        sandbox=SandboxInfo(container_id=sb.container_id if sb else None, image_id=sb.image.id if sb else None,
                            helper_version=sb.helper_version if sb else None, volume=sb.volume if sb else None,
                            recreated=ctx.recreated),
        cli_version=cli_version or load_pins().cli[job.runtime].version, upgraded_from=ctx.upgraded_from,
        timings_ms=ctx.timings, started_at=ctx.started_at, finished_at=datetime.now(UTC),
    )
    mark("receipt_built")
    return receipt


async def standing(store: Store, pool: ResidentPool, member: MemberRecord | None,
                   key: tuple[str, str, str]) -> ContextStatus:
    """The status the member's next turn would have, read from its record, the resident pool
    and the sandbox record only: a refused job starts nothing and changes nothing."""
    sandbox = await store.get_sandbox(*key[:2])
    if sandbox is not None and sandbox.state == SandboxState.LOST:
        return ContextStatus.LOST
    if member is None:
        return ContextStatus.NEW
    if member.lost_reason is not None:
        return ContextStatus.LOST
    if is_new(member):
        return ContextStatus.NEW
    if member.locator is None:
        return ContextStatus.LOST
    resident = pool.get(key)
    if resident is not None and sandbox is not None and serves(resident, member.locator, sandbox.container_id):
        return ContextStatus.LIVE
    return ContextStatus.RESTORED


def note_replacement(ctx: TurnContext) -> None:
    """SPEC 15: where the member's native state was last verified, against where it is now."""
    m, sb = ctx.member, ctx.sandbox
    if m is None or sb is None:
        return
    ctx.recreated = m.last_container_id is not None and m.last_container_id != sb.container_id
    if m.last_image_id is not None and m.last_image_id != sb.image.id:
        ctx.upgraded_from = UpgradedFrom(image_id=m.last_image_id, cli_version=m.last_cli_version)
