"""The durable store: SQLite in WAL mode under CLOUD_AGENT_HOME (migrations: state.migrations).

Invariants kept here rather than trusted to callers:
* the job fence — a job id is claimed once; a repeat sees the first one's state;
* a member's durable locator changes only inside :meth:`Store.finish_job`, in the same
  transaction that records the job's receipt, and only for a :class:`VerifiedTurn`.
SQLite's atomic commit means a ``kill -9`` at any point leaves the whole turn or none.

All calls run on one connection in a worker thread (one at a time), so the event loop
never blocks on disk.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal, TypeVar

import anyio

from state.migrations import migrate
from state.records import (
    JobRecord,
    PendingFork,
    JobState,
    MemberRecord,
    SandboxRecord,
    SandboxState,
    SavedLocator,
)

T = TypeVar("T")


def now() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class VerifiedTurn:
    """A settled turn whose observed locator equalled the expected one (or a NEW one).

    Only this moves a member's durable locator.
    """

    locator: SavedLocator


@dataclass(frozen=True)
class MemberOutcome:
    last_status: str
    last_outcome: str
    verified: VerifiedTurn | None = None  # None: failed / refused / not settled — locator untouched


@dataclass(frozen=True)
class Claim:
    kind: Literal["claimed", "done", "running", "conflict"]
    job: JobRecord | None = None


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._limiter = anyio.CapacityLimiter(1)
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")  # a committed turn survives power loss too
            self._db.execute("PRAGMA foreign_keys=ON")
            migrate(self._db)

    # -- plumbing ---------------------------------------------------------------------------

    @property
    def schema_version(self) -> int:
        with self._lock:
            return self._db.execute("PRAGMA user_version").fetchone()[0]

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        def call() -> T:
            with self._lock:
                return fn(self._db)

        return await anyio.to_thread.run_sync(call, limiter=self._limiter)

    def _tx(self, db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        db.execute("BEGIN IMMEDIATE")
        try:
            result = fn(db)
            db.execute("COMMIT")
            return result
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        with self._lock:
            self._db.close()

    # -- sandboxes --------------------------------------------------------------------------

    async def get_sandbox(self, user_id: str, chat_id: str) -> SandboxRecord | None:
        def q(db: sqlite3.Connection) -> SandboxRecord | None:
            row = db.execute("SELECT * FROM sandboxes WHERE user_id=? AND chat_id=?", (user_id, chat_id)).fetchone()
            return SandboxRecord(**dict(row)) if row else None

        return await self._run(q)

    async def put_sandbox(self, rec: SandboxRecord) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR REPLACE INTO sandboxes VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                (rec.user_id, rec.chat_id, rec.container_id, rec.container_name, rec.image_id, rec.data_root_id,
                 rec.host_id, rec.state.value, rec.lost_reason, rec.created_at.isoformat(),
                 rec.last_used_at.isoformat()),
            )

        await self._run(q)

    async def set_sandbox_state(self, user_id: str, chat_id: str, state: SandboxState,
                                lost_reason: str | None = None) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE sandboxes SET state=?, lost_reason=? WHERE user_id=? AND chat_id=?",
                       (state.value, lost_reason, user_id, chat_id))

        await self._run(q)

    async def touch_sandbox(self, user_id: str, chat_id: str) -> None:
        """A checked, running sandbox about to serve a turn: state and last use, nothing else."""

        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE sandboxes SET state=?, last_used_at=? WHERE user_id=? AND chat_id=?",
                       (SandboxState.RUNNING.value, now().isoformat(), user_id, chat_id))

        await self._run(q)

    async def list_sandboxes(self, state: SandboxState | None = None) -> list[SandboxRecord]:
        def q(db: sqlite3.Connection) -> list[SandboxRecord]:
            if state is None:
                rows = db.execute("SELECT * FROM sandboxes").fetchall()
            else:
                rows = db.execute("SELECT * FROM sandboxes WHERE state=?", (state.value,)).fetchall()
            return [SandboxRecord(**dict(r)) for r in rows]

        return await self._run(q)

    # -- members ----------------------------------------------------------------------------

    @staticmethod
    def _member(row: sqlite3.Row) -> MemberRecord:
        d = dict(row)
        loc_id, loc_path = d.pop("locator_id"), d.pop("locator_path")
        d["locator"] = SavedLocator(id=loc_id, path=loc_path) if loc_id else None
        d["home_member_id"] = d.get("home_member_id") or d["member_id"]
        d["pending_fork"] = PendingFork.model_validate_json(d["pending_fork"]) if d.get("pending_fork") else None
        return MemberRecord(**d)

    async def get_member(self, user_id: str, chat_id: str, member_id: str) -> MemberRecord | None:
        def q(db: sqlite3.Connection) -> MemberRecord | None:
            row = db.execute("SELECT * FROM members WHERE user_id=? AND chat_id=? AND member_id=?",
                             (user_id, chat_id, member_id)).fetchone()
            return self._member(row) if row else None

        return await self._run(q)

    async def list_members(self, user_id: str, chat_id: str) -> list[MemberRecord]:
        def q(db: sqlite3.Connection) -> list[MemberRecord]:
            rows = db.execute("SELECT * FROM members WHERE user_id=? AND chat_id=? ORDER BY created_at, member_id",
                              (user_id, chat_id)).fetchall()
            return [self._member(r) for r in rows]

        return await self._run(q)

    async def ensure_member(self, user_id: str, chat_id: str, member_id: str, runtime: str, *,
                            locator: SavedLocator | None = None, settled_turns: int = 0,
                            forked_from: str | None = None) -> MemberRecord:
        """Create the member if absent (a fork is created with its verified locator); return it."""

        def q(db: sqlite3.Connection) -> MemberRecord:
            ts = now().isoformat()
            db.execute(
                "INSERT OR IGNORE INTO members (user_id, chat_id, member_id, runtime, locator_id, locator_path,"
                " settled_turns, forked_from, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (user_id, chat_id, member_id, runtime, locator.id if locator else None,
                 locator.path if locator else None, settled_turns, forked_from, ts, ts),
            )
            row = db.execute("SELECT * FROM members WHERE user_id=? AND chat_id=? AND member_id=?",
                             (user_id, chat_id, member_id)).fetchone()
            return self._member(row)

        return await self._run(lambda db: self._tx(db, q))

    async def create_fork_member(self, source: MemberRecord, member_id: str, *, home_member_id: str,
                                 locator: SavedLocator | None, settled_turns: int,
                                 pending: PendingFork | None) -> MemberRecord | None:
        """A new member whose native session is a fork of ``source``; None if the id is taken."""

        def q(db: sqlite3.Connection) -> MemberRecord | None:
            ts = now().isoformat()
            cur = db.execute(
                "INSERT OR IGNORE INTO members (user_id, chat_id, member_id, runtime, locator_id, locator_path,"
                " settled_turns, forked_from, home_member_id, pending_fork, created_at, updated_at)"
                " VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                (source.user_id, source.chat_id, member_id, source.runtime, locator.id if locator else None,
                 locator.path if locator else None, settled_turns, source.member_id, home_member_id,
                 pending.model_dump_json() if pending else None, ts, ts),
            )
            if cur.rowcount == 0:
                return None
            row = db.execute("SELECT * FROM members WHERE user_id=? AND chat_id=? AND member_id=?",
                             (source.user_id, source.chat_id, member_id)).fetchone()
            return self._member(row)

        return await self._run(lambda db: self._tx(db, q))

    async def mark_member_lost(self, user_id: str, chat_id: str, member_id: str, reason: str) -> None:
        """Its native state cannot be established any more: every later turn is refused."""

        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE members SET lost_reason=?, updated_at=? WHERE user_id=? AND chat_id=? AND member_id=?"
                       " AND lost_reason IS NULL", (reason, now().isoformat(), user_id, chat_id, member_id))

        await self._run(q)

    async def erase_locator_for_test(self, user_id: str, chat_id: str, member_id: str) -> None:
        """Operator/test tool: simulate a store that lost a member's locator (a LOST case)."""

        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE members SET locator_id=NULL, locator_path=NULL WHERE user_id=? AND chat_id=?"
                       " AND member_id=?", (user_id, chat_id, member_id))

        await self._run(q)

    # -- jobs -------------------------------------------------------------------------------

    @staticmethod
    def _job(row: sqlite3.Row) -> JobRecord:
        return JobRecord(**dict(row))

    async def claim_job(self, job_id: str, user_id: str, chat_id: str, member_id: str,
                        body_digest: str, owner: str) -> Claim:
        """The job fence: the first claim wins; every later one sees the first one's state.

        Job ids are scoped by user: the same id from another user is a different job.
        """

        def q(db: sqlite3.Connection) -> Claim:
            row = db.execute("SELECT * FROM jobs WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
            if row is not None:
                job = self._job(row)
                if job.body_digest != body_digest:
                    return Claim("conflict", job)
                return Claim("done" if job.state == JobState.DONE else "running", job)
            db.execute(
                "INSERT INTO jobs (job_id, user_id, chat_id, member_id, body_digest, state, owner, created_at)"
                " VALUES (?,?,?,?,?,?,?,?)",
                (job_id, user_id, chat_id, member_id, body_digest, JobState.RUNNING.value, owner, now().isoformat()),
            )
            row = db.execute("SELECT * FROM jobs WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
            return Claim("claimed", self._job(row))

        return await self._run(lambda db: self._tx(db, q))

    async def get_job(self, user_id: str, job_id: str) -> JobRecord | None:
        def q(db: sqlite3.Connection) -> JobRecord | None:
            row = db.execute("SELECT * FROM jobs WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
            return self._job(row) if row else None

        return await self._run(q)

    async def finish_job(self, user_id: str, job_id: str, receipt_json: str, member: MemberOutcome | None) -> None:
        """Record the receipt and the member's new state in ONE transaction.

        The durable locator moves only for a :class:`VerifiedTurn`; every other outcome
        leaves it exactly as it was.
        """

        def q(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT * FROM jobs WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
            if row is None:
                raise KeyError(job_id)
            job = self._job(row)
            if job.state == JobState.DONE:
                raise RuntimeError(f"job {job_id} already committed")  # never commit twice
            ts = now().isoformat()
            db.execute("UPDATE jobs SET state=?, receipt_json=?, finished_at=? WHERE user_id=? AND job_id=?",
                       (JobState.DONE.value, receipt_json, ts, user_id, job_id))
            if member is None:
                return
            if member.verified is not None:
                loc = member.verified.locator
                db.execute(
                    "UPDATE members SET locator_id=?, locator_path=?, settled_turns=settled_turns+1, last_status=?,"
                    " last_outcome=?, pending_fork=NULL, updated_at=? WHERE user_id=? AND chat_id=? AND member_id=?",
                    (loc.id, loc.path, member.last_status, member.last_outcome, ts, job.user_id, job.chat_id,
                     job.member_id),
                )
            else:
                db.execute(
                    "UPDATE members SET last_status=?, last_outcome=?, updated_at=? WHERE user_id=? AND chat_id=?"
                    " AND member_id=?",
                    (member.last_status, member.last_outcome, ts, job.user_id, job.chat_id, job.member_id),
                )

        await self._run(lambda db: self._tx(db, q))

    async def running_jobs(self, *, not_owner: str | None = None) -> list[JobRecord]:
        def q(db: sqlite3.Connection) -> list[JobRecord]:
            rows = db.execute("SELECT * FROM jobs WHERE state=?", (JobState.RUNNING.value,)).fetchall()
            return [self._job(r) for r in rows if not_owner is None or r["owner"] != not_owner]

        return await self._run(q)

    async def recent_receipts(self, user_id: str, chat_id: str, limit: int = 10) -> list[str]:
        def q(db: sqlite3.Connection) -> list[str]:
            rows = db.execute(
                "SELECT receipt_json FROM jobs WHERE user_id=? AND chat_id=? AND state=? ORDER BY finished_at DESC"
                " LIMIT ?", (user_id, chat_id, JobState.DONE.value, limit)).fetchall()
            return [r[0] for r in rows]

        return await self._run(q)

    async def chat_jobs(self, user_id: str, chat_id: str, *, member_id: str | None = None,
                        after: tuple[str, str] | None = None, until: tuple[str, str] | None = None,
                        offset: int = 0, limit: int = 50, newest_first: bool = False) -> list[JobRecord]:
        """A chat's jobs (running ones too) in start order: ``(created_at, job_id)``, a total order
        that a later job never reorders, so a cursor of the last row seen pages stably."""
        where, args = ["user_id=?", "chat_id=?"], [user_id, chat_id]
        if member_id is not None:
            where.append("member_id=?")
            args.append(member_id)
        if after is not None:
            where.append("(created_at > ? OR (created_at = ? AND job_id > ?))")
            args += [after[0], after[0], after[1]]
        if until is not None:
            where.append("(created_at < ? OR (created_at = ? AND job_id <= ?))")
            args += [until[0], until[0], until[1]]
        order = "DESC" if newest_first else "ASC"
        sql = (f"SELECT * FROM jobs WHERE {' AND '.join(where)} ORDER BY created_at {order}, job_id {order}"  # noqa: S608
               " LIMIT ? OFFSET ?")

        def q(db: sqlite3.Connection) -> list[JobRecord]:
            return [self._job(r) for r in db.execute(sql, (*args, limit, offset)).fetchall()]

        return await self._run(q)

    async def count_chat_jobs(self, user_id: str, chat_id: str, *, before: tuple[str, str] | None = None) -> int:
        """How many of the chat's jobs start before ``before`` (all of them without it)."""
        sql, args = "SELECT COUNT(*) FROM jobs WHERE user_id=? AND chat_id=?", [user_id, chat_id]
        if before is not None:
            sql += " AND (created_at < ? OR (created_at = ? AND job_id < ?))"
            args += [before[0], before[0], before[1]]

        def q(db: sqlite3.Connection) -> int:
            return int(db.execute(sql, args).fetchone()[0])

        return await self._run(q)

    def raw_rows(self, table: str) -> list[dict[str, Any]]:
        """Synchronous read for tests and operators (e.g. after a kill -9)."""
        with self._lock:
            return [dict(r) for r in self._db.execute(f"SELECT * FROM {table}")]  # noqa: S608 - fixed names
