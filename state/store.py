"""The durable store: SQLite in WAL mode under CLOUD_AGENT_HOME (migrations: state.migrations).

The embedded default implementation of :class:`state.contract.StoreContract` (the
invariants are listed there; ``state.postgres`` is the fleet's implementation). SQLite's
atomic commit means a ``kill -9`` at any point leaves the whole turn or none.

All calls run on one connection in the store's own thread (state.store_thread, one at a
time), so the event loop never blocks on disk; ``BEGIN IMMEDIATE`` serialises every writing
transaction.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import anyio

from state.chat_deletion import SQLiteChatDeletion
from state.contract import (
    Claim,
    Fenced,
    HostLease,
    MemberOutcome,
    StoreUnavailable,
    VerifiedIn,
    VerifiedTurn,
    fork_where,
    now,
)
from state.keepers import SQLiteKeepers, sqlite_put_keeper
from state.migrations import migrate
from state.records import (
    JobRecord,
    JobState,
    MemberRecord,
    PendingFork,
    SandboxRecord,
    SandboxState,
    SavedLocator,
)
from state.sandbox_writes import SandboxWrites, SeenSandbox
from state.sqlite_fleet import NOW_MS, SQLiteFleet
from state.store_thread import StoreThread
from state.wal_flush_child import flush as fsync_first_of
from state.wal_flusher import FlusherGone, FlushFailed, WalFlusher
from state.wire_ledger import (
    SettleQuery,
    SQLiteWireLedger,
    WireSettleView,
    sqlite_put_turn,
    sqlite_settle_view,
)

T = TypeVar("T")

__all__ = ["Claim", "MemberOutcome", "Store", "VerifiedTurn", "now"]

class Store(SQLiteFleet, SQLiteWireLedger, SQLiteChatDeletion, SQLiteKeepers):
    def __init__(self, path: Path, *, sync_commits: bool = True) -> None:
        """``sync_commits=False``: a commit is not flushed to disk by itself but by the next
        one that is (the WAL is one file, appended in order; see :func:`state.backends.open_store`)."""
        self.path = path
        self.sync_commits = sync_commits
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.Lock()
        self._thread = StoreThread(f"store {path.name}")
        self._lease: HostLease | None = None
        self.sandbox_writes = SandboxWrites()
        self._wal_paths = [f"{path}-wal", str(path)]  # what a flush fsyncs: the first that exists
        # relaxed commits a caller flushes later (a claim): fsynced by a process of its own
        self.flusher = WalFlusher(self._wal_paths) if sync_commits else None
        self._thread_flushed = 0  # relaxed commits a thread's fsync covered once the flusher was gone
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            # FULL: a committed turn survives power loss too. NORMAL (the proxy's records): the
            # WAL is flushed by the next FULL commit of any connection, or at a checkpoint
            self._db.execute("PRAGMA synchronous=FULL" if sync_commits else "PRAGMA synchronous=NORMAL")
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

        return await self._thread.run(call)

    async def _write_sandbox(self, user_id: str, chat_id: str, fn: Callable[[sqlite3.Connection], None]) -> None:
        try:
            await self._run(fn)
        finally:
            self.sandbox_writes.wrote(user_id, chat_id)

    def _tx(self, db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], *, sync: bool = True,
            flush_now: bool = False) -> T:
        """One writing transaction. ``sync=False``: its commit is written to the WAL but not
        flushed (it survives the process, not the machine) until :meth:`sync` or the next
        flushed commit of any connection; ``flush_now``: the flusher starts on it as it returns
        (the caller's :meth:`sync` then waits for that flush)."""
        relaxed = not sync and self.sync_commits
        if relaxed:
            db.execute("PRAGMA synchronous=NORMAL")  # outside the transaction: SQLite's rule
        try:
            db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(db)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise
            if relaxed and self.flusher is not None:
                self.flusher.committed(flush=flush_now)
            return result
        finally:
            if relaxed:
                db.execute("PRAGMA synchronous=FULL")

    async def sync(self) -> None:
        """Every commit made so far is on disk when this returns (those made with ``sync=False``
        included): the WAL file's fsync, by the flusher's process (state.wal_flusher), or with
        none on a worker thread of its own, so the connection's thread serves reads meanwhile."""
        made = None
        if self.flusher is not None:
            try:
                await self.flusher.wait()
                return
            except FlusherGone:
                # flushed here instead (``flusher.gone`` says why); every response of the
                # daemon asks (runner.durable_responses), so only when a relaxed commit came since
                made = self.flusher.made
                if made <= self._thread_flushed:
                    return
            except FlushFailed as exc:
                raise StoreUnavailable(f"a commit did not reach the disk: {exc}") from exc
        await anyio.to_thread.run_sync(fsync_first_of, self._wal_paths)  # the flusher's own fsync
        if made is not None:
            self._thread_flushed = max(self._thread_flushed, made)

    def close(self) -> None:
        if self.flusher is not None:
            self.flusher.close()
        with self._lock:
            self._db.close()

    async def open(self) -> None:
        """The flusher's process starts (the file is opened and migrated by the constructor)."""
        if self.flusher is not None:
            await anyio.to_thread.run_sync(self.flusher.start)  # a fork and exec: off the loop

    async def aclose(self) -> None:
        """A turn's commit may still be on its way to the disk (``settle_job(sync=False)``): it
        gets there before the store closes."""
        try:
            await self.sync()
        except StoreUnavailable:
            pass  # nothing more can reach the disk: closed all the same
        finally:
            self.close()

    def bind_lease(self, lease: HostLease | None) -> None:
        """Claims and commits from now on require this lease to be live (the host fence)."""
        self._lease = lease

    def _check_lease(self, db: sqlite3.Connection) -> None:
        lease = self._lease
        if lease is None:
            return
        row = db.execute(f"SELECT 1 FROM hosts WHERE host_id=? AND epoch=? AND state='live' AND lease_until_ms > {NOW_MS}",
                         (lease.host_id, lease.epoch)).fetchone()
        if row is None:
            raise Fenced(f"host {lease.host_id} epoch {lease.epoch}: lease expired or superseded")

    # -- sandboxes --------------------------------------------------------------------------

    async def get_sandbox(self, user_id: str, chat_id: str) -> SandboxRecord | None:
        def q(db: sqlite3.Connection) -> SandboxRecord | None:
            row = db.execute("SELECT * FROM sandboxes WHERE user_id=? AND chat_id=?", (user_id, chat_id)).fetchone()
            return SandboxRecord(**dict(row)) if row else None

        return await self._run(q)

    async def put_sandbox(self, rec: SandboxRecord) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.execute(
                "INSERT OR REPLACE INTO sandboxes (user_id, chat_id, container_id, container_name, image_id,"
                " data_root_id, host_id, state, lost_reason, stop_reason, created_at, last_used_at, volume_name,"
                " volume_id) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (rec.user_id, rec.chat_id, rec.container_id, rec.container_name, rec.image_id, rec.data_root_id,
                 rec.host_id, rec.state.value, rec.lost_reason, rec.stop_reason, rec.created_at.isoformat(),
                 rec.last_used_at.isoformat(), rec.volume_name, rec.volume_id),
            )

        await self._write_sandbox(rec.user_id, rec.chat_id, q)

    async def set_sandbox_state(self, user_id: str, chat_id: str, state: SandboxState,
                                lost_reason: str | None = None) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE sandboxes SET state=?, lost_reason=? WHERE user_id=? AND chat_id=?",
                       (state.value, lost_reason, user_id, chat_id))

        await self._write_sandbox(user_id, chat_id, q)

    async def set_stop_reason(self, user_id: str, chat_id: str, reason: str | None) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE sandboxes SET stop_reason=? WHERE user_id=? AND chat_id=?", (reason, user_id, chat_id))

        await self._write_sandbox(user_id, chat_id, q)

    async def touch_sandbox(self, user_id: str, chat_id: str) -> None:
        """A checked, running sandbox about to serve a turn: state and last use, nothing else.

        Not flushed by itself (the turn's commit flushes it): a container a crash of the
        machine stopped is not running whatever the record says, and a daemon that restarts
        reads the commit. A RESTORED turn waited for its fsync between the start and the launch."""

        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE sandboxes SET state=?, last_used_at=? WHERE user_id=? AND chat_id=?",
                       (SandboxState.RUNNING.value, now().isoformat(), user_id, chat_id))

        await self._write_sandbox(user_id, chat_id, lambda db: self._tx(db, q, sync=False))

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

    @classmethod
    def _member_at(cls, db: sqlite3.Connection, user_id: str, chat_id: str, member_id: str) -> MemberRecord | None:
        row = db.execute("SELECT * FROM members WHERE user_id=? AND chat_id=? AND member_id=?",
                         (user_id, chat_id, member_id)).fetchone()
        return cls._member(row) if row else None

    async def get_member(self, user_id: str, chat_id: str, member_id: str) -> MemberRecord | None:
        return await self._run(lambda db: self._member_at(db, user_id, chat_id, member_id))

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
            member = self._member_at(db, user_id, chat_id, member_id)
            assert member is not None  # inserted, or there already
            return member

        return await self._run(lambda db: self._tx(db, q))

    async def create_fork_member(self, source: MemberRecord, member_id: str, *, home_member_id: str,
                                 locator: SavedLocator | None, settled_turns: int,
                                 pending: PendingFork | None, where: VerifiedIn | None = None) -> MemberRecord | None:
        """A new member whose native session is a fork of ``source``; None if the id is taken."""

        def q(db: sqlite3.Connection) -> MemberRecord | None:
            ts = now().isoformat()
            cur = db.execute(
                "INSERT OR IGNORE INTO members (user_id, chat_id, member_id, runtime, locator_id, locator_path,"
                " settled_turns, forked_from, home_member_id, pending_fork, created_at, updated_at,"
                " last_container_id, last_image_id, last_cli_version) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",
                (source.user_id, source.chat_id, member_id, source.runtime, locator.id if locator else None,
                 locator.path if locator else None, settled_turns, source.member_id, home_member_id,
                 pending.model_dump_json() if pending else None, ts, ts,
                 *fork_where(source, where)),
            )
            if cur.rowcount == 0:
                return None
            return self._member_at(db, source.user_id, source.chat_id, member_id)

        return await self._run(lambda db: self._tx(db, q))

    async def mark_member_lost(self, user_id: str, chat_id: str, member_id: str, reason: str) -> None:
        """Its native state cannot be established any more: every later turn is refused."""

        def q(db: sqlite3.Connection) -> None:
            db.execute("UPDATE members SET lost_reason=?, updated_at=? WHERE user_id=? AND chat_id=? AND member_id=?"
                       " AND lost_reason IS NULL", (reason, now().isoformat(), user_id, chat_id, member_id))

        await self._run(q)

    # -- jobs -------------------------------------------------------------------------------

    @staticmethod
    def _job(row: sqlite3.Row) -> JobRecord:
        return JobRecord(**dict(row))

    async def claim_job(self, job_id: str, user_id: str, chat_id: str, member_id: str,
                        body_digest: str, owner: str, *, sync: bool = True, read_member: bool = False,
                        read_sandbox: bool = False) -> Claim:
        """The job fence: the first claim wins; every later one sees the first one's state.

        Job ids are scoped by user: the same id from another user is a different job.
        ``sync=False``: the claim fences at once but reaches the disk with :meth:`sync`, which
        the caller awaits before anything the claim fences happens (the CLI's input).
        ``read_member``: a job claimed here comes with its member's record, read in the same
        transaction (:attr:`Claim.member`); ``read_sandbox``: and with the chat's sandbox record
        (:attr:`Claim.sandbox`, state.sandbox_writes).
        """

        lease = self._lease
        after = self.sandbox_writes.now()

        def q(db: sqlite3.Connection) -> Claim:
            row = db.execute("SELECT * FROM jobs WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
            if row is not None:
                job = self._job(row)
                if job.body_digest != body_digest:
                    return Claim("conflict", job)
                return Claim("done" if job.state == JobState.DONE else "running", job)
            self._check_lease(db)
            db.execute(
                "INSERT INTO jobs (job_id, user_id, chat_id, member_id, body_digest, state, owner, created_at,"
                " host_id, host_epoch) VALUES (?,?,?,?,?,?,?,?,?,?)",
                (job_id, user_id, chat_id, member_id, body_digest, JobState.RUNNING.value, owner, now().isoformat(),
                 lease.host_id if lease else None, lease.epoch if lease else None),
            )
            row = db.execute("SELECT * FROM jobs WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
            member = self._member_at(db, user_id, chat_id, member_id) if read_member else None
            sandbox = None
            if read_sandbox:
                found = db.execute("SELECT * FROM sandboxes WHERE user_id=? AND chat_id=?", (user_id, chat_id)).fetchone()
                sandbox = SeenSandbox(user_id, chat_id, SandboxRecord(**dict(found)) if found else None, after)
            return Claim("claimed", self._job(row), member, sandbox)

        return await self._run(lambda db: self._tx(db, q, sync=sync, flush_now=not sync))

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
        try:
            await self._run(lambda db: self._tx(db, lambda d: self._finish(d, self._running_job(d, user_id, job_id),
                                                                           receipt_json, member)))
        finally:
            self.sandbox_writes.wrote_some()  # the job's chat's sandbox: its last use

    async def settle_job(self, user_id: str, job_id: str, query: SettleQuery,
                         decide: Callable[[WireSettleView], tuple[str, MemberOutcome | None]], *,
                         sync: bool = True) -> None:
        """:meth:`finish_job` with the receipt decided inside the same transaction, from the
        ledger view its wire verdict reads (``decide`` runs on the store's thread).
        ``sync=False``: returns once committed, its flush under way; on disk once :meth:`sync`
        returns (a turn's commit: the receipt is framed meanwhile)."""

        def q(db: sqlite3.Connection) -> None:
            job = self._running_job(db, user_id, job_id)
            receipt_json, member = decide(sqlite_settle_view(db, user_id, job_id, query))
            self._finish(db, job, receipt_json, member)

        try:
            # A relaxed commit the flusher flushes at once. As a synchronous commit, the fsync
            # held the store's thread (1.7 ms at p50, 5.6 at p90 under 16 chats' turns), and
            # every other chat's claim and keeper record waited behind it; now the thread serves
            # them while the disk works, and one flush covers every commit made meanwhile. Such
            # a commit is visible to this process's readers before it is durable: no response
            # of the daemon starts or ends before it is (runner.durable_responses).
            await self._run(lambda db: self._tx(db, q, sync=False, flush_now=True))
            if sync and self.sync_commits:
                await self.sync()
        finally:
            self.sandbox_writes.wrote(user_id, query.chat_id)  # the sandbox's last use

    def _running_job(self, db: sqlite3.Connection, user_id: str, job_id: str) -> JobRecord:
        """The job about to be committed: still running, and this host's lease live."""
        row = db.execute("SELECT * FROM jobs WHERE user_id=? AND job_id=?", (user_id, job_id)).fetchone()
        if row is None:
            raise KeyError(job_id)
        job = self._job(row)
        if job.state == JobState.DONE:
            self._check_lease(db)  # closed by another host because this one is fenced
            raise RuntimeError(f"job {job_id} already committed")  # never commit twice
        self._check_lease(db)  # a host that lost its lease never commits late
        return job

    def _finish(self, db: sqlite3.Connection, job: JobRecord, receipt_json: str, member: MemberOutcome | None) -> None:
        user_id, job_id = job.user_id, job.job_id
        ts = now().isoformat()
        db.execute("UPDATE jobs SET state=?, receipt_json=?, finished_at=? WHERE user_id=? AND job_id=?",
                   (JobState.DONE.value, receipt_json, ts, user_id, job_id))
        if member is None:
            return
        if member.wire is not None:
            sqlite_put_turn(db, member.wire)
        if member.keeper is not None:
            sqlite_put_keeper(db, member.keeper)
        if member.verified is not None:
            v = member.verified
            loc, at = v.locator, v.where or VerifiedIn()
            db.execute(
                "UPDATE members SET locator_id=?, locator_path=?, settled_turns=settled_turns+1, last_status=?,"
                " last_outcome=?, pending_fork=NULL, updated_at=?, last_container_id=?, last_image_id=?,"
                " last_cli_version=? WHERE user_id=? AND chat_id=? AND member_id=?",
                (loc.id, loc.path, member.last_status, member.last_outcome, ts, at.container_id, at.image_id,
                 at.cli_version, job.user_id, job.chat_id, job.member_id),
            )
        else:
            db.execute(
                "UPDATE members SET last_status=?, last_outcome=?, updated_at=? WHERE user_id=? AND chat_id=?"
                " AND member_id=?",
                (member.last_status, member.last_outcome, ts, job.user_id, job.chat_id, job.member_id),
            )
        # the sandbox's last use, in the same transaction (no write of its own per turn)
        db.execute("UPDATE sandboxes SET last_used_at=? WHERE user_id=? AND chat_id=? AND state=?",
                   (ts, job.user_id, job.chat_id, SandboxState.RUNNING.value))

    async def running_jobs(self, *, not_owner: str | None = None, host_id: str | None = None) -> list[JobRecord]:
        """Running jobs; ``host_id``: only those that host claimed (or unbound ones)."""

        def q(db: sqlite3.Connection) -> list[JobRecord]:
            rows = db.execute("SELECT * FROM jobs WHERE state=?", (JobState.RUNNING.value,)).fetchall()
            return [self._job(r) for r in rows if (not_owner is None or r["owner"] != not_owner)
                    and (host_id is None or r["host_id"] in (None, host_id))]

        return await self._run(q)

    async def close_orphaned_job(self, user_id: str, job_id: str, receipt_json: str) -> bool:
        """Close a running job whose host epoch is no longer live (fencing that host first)."""

        def q(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT host_id, host_epoch FROM jobs WHERE user_id=? AND job_id=? AND state=?",
                             (user_id, job_id, JobState.RUNNING.value)).fetchone()
            if row is None or row["host_id"] is None:
                return False
            db.execute(f"UPDATE hosts SET state='fenced' WHERE host_id=? AND epoch=? AND state='live'"
                       f" AND lease_until_ms <= {NOW_MS}", (row["host_id"], row["host_epoch"]))
            cur = db.execute(
                "UPDATE jobs SET state=?, receipt_json=?, finished_at=? WHERE user_id=? AND job_id=? AND state=?"
                " AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.host_id=jobs.host_id AND h.epoch=jobs.host_epoch"
                "                 AND h.state='live')",
                (JobState.DONE.value, receipt_json, now().isoformat(), user_id, job_id, JobState.RUNNING.value))
            return cur.rowcount == 1

        return await self._run(lambda db: self._tx(db, q))

    async def recent_receipts(self, user_id: str, chat_id: str, limit: int = 10) -> list[str]:
        def q(db: sqlite3.Connection) -> list[str]:
            rows = db.execute(
                "SELECT receipt_json FROM jobs WHERE user_id=? AND chat_id=? AND state=? AND deleted_at IS NULL"
                " ORDER BY finished_at DESC"
                " LIMIT ?", (user_id, chat_id, JobState.DONE.value, limit)).fetchall()
            return [r[0] for r in rows]

        return await self._run(q)

    async def chat_jobs(self, user_id: str, chat_id: str, *, member_id: str | None = None,
                        after: tuple[str, str] | None = None, until: tuple[str, str] | None = None,
                        offset: int = 0, limit: int = 50, newest_first: bool = False) -> list[JobRecord]:
        """A chat's jobs (running ones too) in start order: ``(created_at, job_id)``, a total order
        that a later job never reorders, so a cursor of the last row seen pages stably."""
        where, args = ["user_id=?", "chat_id=?", "deleted_at IS NULL"], [user_id, chat_id]
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
        sql, args = "SELECT COUNT(*) FROM jobs WHERE user_id=? AND chat_id=? AND deleted_at IS NULL", [user_id, chat_id]
        if before is not None:
            sql += " AND (created_at < ? OR (created_at = ? AND job_id < ?))"
            args += [before[0], before[0], before[1]]

        def q(db: sqlite3.Connection) -> int:
            return int(db.execute(sql, args).fetchone()[0])

        return await self._run(q)
