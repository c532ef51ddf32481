"""What the supervisor does after a restart (SPEC 14), before it admits any job: re-adopt
the keepers (``runner.readopt``), close the jobs a dead daemon left that none of them can
finish, reap the CLI processes nobody owns, and finish the turns that were in flight on the
re-adopted keepers — each under its member's lock, taken before any job is admitted."""

from __future__ import annotations

import anyio
import structlog
from anyio.abc import TaskStatus

from runner.member_locks import MemberLocks
from runner.metrics import Metrics
from runner.not_settled import close_unsettled
from runner.readopt import Pending, abandon, readopt
from runner.residents import ResidentPool
from runner.turn import TurnRunner
from runner.turn_context import Detached
from sandbox_manager.sandboxes import SandboxManager
from state.contract import StoreContract
from state.keepers import KeeperRecord

log = structlog.get_logger("supervisor")


class Recovery:
    def __init__(self, *, store: StoreContract, manager: SandboxManager, runner: TurnRunner, pool: ResidentPool,
                 locks: MemberLocks, metrics: Metrics, owner: str) -> None:
        self.store = store
        self.manager = manager
        self.runner = runner
        self.pool = pool
        self.locks = locks
        self.metrics = metrics
        self.owner = owner

    async def recover(self) -> list[Pending]:
        """After a restart (SPEC 14): re-adopt the keepers whose identity matches (their
        residents serve the next turn LIVE); the turns in flight on them are returned, to be
        finished. Other jobs a dead daemon left running never ran to commit: close them as
        not_settled (never re-run: the CLI may already have sent the message). Kill the CLI
        processes left in retained sandboxes that no re-adopted keeper owns."""
        # only this host's jobs: in a fleet the store holds every host's (SPEC 16)
        running = await self.store.running_jobs(not_owner=self.owner, host_id=self.manager.config.host_id)
        keep: dict[str, set[str]] = {}
        pending: list[Pending] = []
        records: dict[tuple[str, str, str], KeeperRecord] = {}
        try:
            adoption, records = await readopt(self.runner, {r.job_id for r in running})
            keep, pending = adoption.keep_dirs(records), adoption.pending
        except Exception as exc:  # noqa: BLE001 - the engine may be down: nothing adopted, all reaped
            log.warning("readopt.failed", error=repr(exc))
        finishing = {p.job.job_id for p in pending}
        await abandon(self.store, [rec for rec in running if rec.job_id not in finishing], records)
        try:
            n = await self.manager.reap_orphans(keep=keep)
        except Exception as exc:  # noqa: BLE001 - the engine may be down; readiness says so
            log.warning("reap_orphans.failed", error=repr(exc))
            n = 0
        if n:
            log.info("orphans.reaped", groups=n)
        return pending

    async def finish(self, p: Pending, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Finish a turn in flight at the last restart, under the member's lock."""
        assert p.record.turn is not None
        async with self.locks.hold(p.key):
            task_status.started()
            try:
                receipt = await self.runner.finish(p.job, p.record.turn)
                self.metrics.observe(receipt)
                log.info("job.finished_after_restart", job_id=p.job.job_id, outcome=receipt.outcome)
            except Detached:
                pass  # shutting down again: the next daemon finishes it
            except Exception as exc:  # noqa: BLE001 - a bug must not take the daemon down
                log.exception("job.finish_crashed", job_id=p.job.job_id, error=repr(exc))
                try:
                    await self.pool.retire(p.key, "finish crashed")
                    await close_unsettled(self.store, p.job, "daemon_restarted")
                except Exception:  # noqa: BLE001
                    pass
