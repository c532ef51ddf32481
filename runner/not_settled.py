"""Closing a job ``not_settled`` when no turn committed for it (the store went away mid-turn,
its chat's deletion cancelled it before its turn ran, finishing it after a restart crashed):
the receipt says why, and the member's locator stays where it was."""

from __future__ import annotations

from datetime import UTC, datetime

import anyio

from state.contract import StoreContract
from state.jobs import Job
from state.receipts import Outcome, Receipt


async def close_unsettled(store: StoreContract, job: Job, reason: str) -> Receipt:
    member = await store.get_member(job.user_id, job.chat_id, job.member_id)
    locator = member.locator.id if member and member.locator else None
    now = datetime.now(UTC)
    receipt = Receipt(job_id=job.job_id, user_id=job.user_id, chat_id=job.chat_id, member_id=job.member_id,
                      runtime=job.runtime, context_status=None, outcome=Outcome.NOT_SETTLED, reason=reason,
                      locator_before=locator, locator_after=locator, started_at=now, finished_at=now)
    with anyio.CancelScope(shield=True):
        await store.finish_job(job.user_id, job.job_id, receipt.model_dump_json(), None)
    return receipt
