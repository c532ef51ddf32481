"""A turn's commit (SPEC 8 and 12): its wire verdict, receipt and member state in one transaction.

The proxy's flush comes first: the member's requests stop belonging to the job with it (a turn
being committed is never one left to the next daemon; the end the turn's ``finally`` asks for
again is then a no-op). Then one store call reads the ledger view the verdict needs, judges it
and writes the receipt with the member's new state (``Store.settle_job``): one round trip to
the store where a read and a commit were two (issue 16).
"""

from __future__ import annotations

import anyio
import structlog

from drivers.models import Locator
from runner.model_path import ModelPath
from runner.turn_context import TurnContext, to_saved
from state.contract import MemberOutcome, StoreContract, VerifiedIn, VerifiedTurn
from state.keepers import KeeperRecord
from state.receipts import Receipt
from state.wire_ledger import WireSettleView
from telemetry.turn_trace import mark

log = structlog.get_logger("turn")


async def commit_turn(store: StoreContract, model_path: ModelPath, ctx: TurnContext, receipt: Receipt,
                      verified: Locator | None, keeper: KeeperRecord | None = None) -> Receipt:
    """Commit ``receipt`` with its wire verdict; returns the receipt as committed. The durable
    locator moves only with ``verified`` (the CLI's own id, checked at settlement)."""
    with anyio.CancelScope(shield=True):
        if ctx.proxy_begun is not None:
            await ctx.proxy_begun()  # the settle's flush ends what the begin began: after it
        await model_path.flush(receipt)
    mark("wire_flushed")
    settled = (ctx.member.settled_turns if ctx.member else 0) + (1 if verified is not None else 0)
    where = VerifiedIn(container_id=receipt.sandbox.container_id, image_id=receipt.sandbox.image_id,
                       cli_version=receipt.cli_version)
    decided: list[Receipt] = []

    query = model_path.settle_query(receipt, ctx.member)

    def decide(view: WireSettleView) -> tuple[str, MemberOutcome]:
        """On the store's thread, inside the commit's transaction (it may run once per attempt)."""
        wire, row = model_path.judge(receipt, ctx.member, query, view, message=ctx.job.message,
                                     compaction=ctx.compacted, settled_index=settled)
        final = receipt.model_copy(update={"wire": wire})
        decided.append(final)
        return final.model_dump_json(), MemberOutcome(
            last_status=final.context_status.value if final.context_status else "-",
            last_outcome=final.outcome.value,
            verified=VerifiedTurn(to_saved(verified), where) if verified is not None else None,
            wire=row,
            keeper=keeper,
        )

    with anyio.CancelScope(shield=True):
        # Returns once committed, its flush under way: the receipt is framed meanwhile, and the
        # response that carries it ends only once it is on disk (runner.durable_responses). The
        # member's next turn is on disk after it too: its claim's flush covers this commit.
        await store.settle_job(receipt.user_id, receipt.job_id, query, decide, sync=False)
    committed = decided[-1]  # the last attempt's (an unacknowledged commit stands)
    if committed.wire is not None:
        model_path.count_verdict(committed.runtime, committed.wire)
    mark("committed")
    log.info("turn.committed", job_id=committed.job_id, runtime=committed.runtime,
             status=committed.context_status, outcome=committed.outcome, reason=committed.reason,
             total_ms=committed.timings_ms.total, wire=committed.wire.history if committed.wire else None)
    return committed
