"""The PostgreSQL store (``CLOUD_AGENT_STORE_URL=postgresql://…``): the fleet's shared store.

Implements :class:`state.contract.StoreContract` with psycopg 3's async API and its pool
(never a blocking call on the event loop). Same migrations as SQLite (``state.migrations``,
counted in ``schema_version``, applied under an advisory lock so hosts starting together
migrate once), same job fence, same atomic commit rule.

Concurrency, in READ COMMITTED:
* the fence: ``INSERT … ON CONFLICT DO NOTHING`` — a second claimer waits for the first
  one's transaction and then sees its row; exactly one claim wins;
* the commit: ``UPDATE jobs … WHERE state='running'`` decides once; the host lease is read
  ``FOR SHARE`` in the same transaction, so a fencer (``UPDATE hosts SET state='fenced'``)
  and a commit are ordered: a commit after the fence finds no live lease and writes nothing;
* a lease is judged by the database's clock (:data:`NOW_MS`), the one clock all hosts share.

A lost connection (the server restarting) is :class:`StoreUnavailable`; a commit retries
for a while and recognises its own receipt if the first attempt did commit.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import psycopg
import structlog
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from state.contract import (
    Claim,
    Fenced,
    HostLease,
    MemberOutcome,
    StoreUnavailable,
    VerifiedIn,
    fork_where,
    now,
)
from state.migrations import MIGRATIONS
from state.sandbox_writes import SandboxWrites, SeenSandbox
from state.keepers import PostgresKeepers, postgres_put_keeper
from state.postgres_fleet import NOW_MS, Conn, PostgresFleet
from state.chat_deletion import PostgresChatDeletion
from state.wire_ledger import PostgresWireLedger, SettleQuery, WireSettleView, postgres_put_turn, postgres_settle_view
from state.records import JobRecord, JobState, MemberRecord, PendingFork, SandboxRecord, SandboxState, SavedLocator
from state.store import Store as _SQLiteRows  # row -> record mapping only

log = structlog.get_logger("store.postgres")

T = TypeVar("T")
MIGRATION_LOCK = 0x5CA6E17  # pg_advisory_xact_lock key: one migrator at a time


def redact(url: str) -> str:
    """The URL without its password (for logs and errors)."""
    try:
        info = psycopg.conninfo.conninfo_to_dict(url)
    except psycopg.ProgrammingError:
        return "postgresql://(unparsable)"
    return f"postgresql://{info.get('user', '')}@{info.get('host', '')}:{info.get('port', '')}/{info.get('dbname', '')}"


async def _decided(receipt_json: str, member: MemberOutcome | None) -> tuple[str, MemberOutcome | None]:
    return receipt_json, member


class PostgresStore(PostgresFleet, PostgresWireLedger, PostgresChatDeletion, PostgresKeepers):
    def __init__(self, url: str, *, min_size: int = 1, max_size: int = 8, timeout_s: float = 10.0,
                 commit_retry_s: float = 20.0, retry_s: float = 10.0, sync_commits: bool = True) -> None:
        self.url = url
        self.commit_retry_s = commit_retry_s
        self.retry_s = retry_s
        self._pool = AsyncConnectionPool(
            url, min_size=min_size, max_size=max_size, timeout=timeout_s, open=False,
            check=AsyncConnectionPool.check_connection,  # drop connections a restart broke
            kwargs={"autocommit": True, "row_factory": dict_row, "connect_timeout": max(2, int(timeout_s)),
                    **({} if sync_commits else {"options": "-c synchronous_commit=off"})},
        )
        self._lease: HostLease | None = None
        self.sandbox_writes = SandboxWrites()
        self._version = 0
        self._opened = False

    # -- plumbing ---------------------------------------------------------------------------

    async def open(self) -> None:
        """Connect and migrate; idempotent (the fleet and the supervisor both ask)."""
        if self._opened:
            return
        try:
            await self._pool.open(wait=True, timeout=self._pool.timeout)
        except PoolTimeout as exc:
            raise StoreUnavailable(f"cannot connect to {redact(self.url)}") from exc
        await self._migrate()
        self._opened = True

    async def sync(self) -> None:
        """Nothing to wait for: the server flushes every synced commit before answering, and a
        ``sync=False`` write is made synced here. (A store opened with ``sync_commits=False``,
        the model proxy's, is flushed by the server's WAL writer within its delay instead.)"""

    async def aclose(self) -> None:
        await self._drop_lease_conn()
        await self._pool.close()

    def close(self) -> None:
        """Synchronous close is not possible for the async pool; use :meth:`aclose`."""

    @property
    def schema_version(self) -> int:
        return self._version

    def bind_lease(self, lease: HostLease | None) -> None:
        self._lease = lease

    async def _tx_once(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """One transaction; a lost server is StoreUnavailable. For writes whose retry after an
        unacknowledged commit would mean something else (the job claim, a fork's insert)."""
        try:
            async with self._pool.connection() as conn, conn.transaction():
                return await fn(conn)
        except (psycopg.OperationalError, psycopg.InterfaceError, PoolTimeout) as exc:
            if isinstance(exc, psycopg.errors.QueryCanceled):
                raise
            raise StoreUnavailable(f"store {redact(self.url)}: {type(exc).__name__}") from exc

    async def _tx(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        """Reads and idempotent writes ride out a short outage (a server restart) by retrying."""
        deadline = time.monotonic() + self.retry_s
        attempt = 0
        while True:
            try:
                return await self._tx_once(fn)
            except StoreUnavailable:
                if time.monotonic() > deadline:
                    raise
                attempt += 1
                await anyio.sleep(min(1.0, 0.1 * attempt))

    async def _migrate(self) -> None:
        async def version(conn: Conn) -> int:
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
            row = await self._one(conn, "SELECT version FROM schema_version")
            if row is None:
                await conn.execute("INSERT INTO schema_version VALUES (0)")
                return 0
            return int(row["version"])

        for i in range(await self._tx(version), len(MIGRATIONS)):
            async def step(conn: Conn, i: int = i) -> None:
                if await version(conn) != i:
                    return  # another host applied it meanwhile
                for stmt in filter(str.strip, MIGRATIONS[i].split(";")):
                    await conn.execute(stmt)
                await conn.execute("UPDATE schema_version SET version=%s", (i + 1,))

            await self._tx(step)
            log.info("store.migrated", version=i + 1)
        self._version = await self._tx(version)

    async def _check_lease(self, conn: Conn) -> None:
        lease = self._lease
        if lease is None:
            return
        row = await self._one(conn, f"SELECT 1 FROM hosts WHERE host_id=%s AND epoch=%s AND state='live'"
                                    f" AND lease_until_ms > {NOW_MS} FOR SHARE", (lease.host_id, lease.epoch))
        if row is None:
            raise Fenced(f"host {lease.host_id} epoch {lease.epoch}: lease expired or superseded")

    # -- sandboxes --------------------------------------------------------------------------

    async def get_sandbox(self, user_id: str, chat_id: str) -> SandboxRecord | None:
        async def q(conn: Conn) -> SandboxRecord | None:
            row = await self._one(conn, "SELECT * FROM sandboxes WHERE user_id=%s AND chat_id=%s", (user_id, chat_id))
            return SandboxRecord(**row) if row else None

        return await self._tx(q)

    async def put_sandbox(self, rec: SandboxRecord) -> None:
        async def q(conn: Conn) -> None:
            await conn.execute(
                "INSERT INTO sandboxes (user_id, chat_id, container_id, container_name, image_id, data_root_id,"
                " host_id, state, lost_reason, stop_reason, created_at, last_used_at, volume_name, volume_id)"
                " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (user_id, chat_id) DO UPDATE SET container_id=excluded.container_id,"
                " container_name=excluded.container_name, image_id=excluded.image_id,"
                " data_root_id=excluded.data_root_id, host_id=excluded.host_id, state=excluded.state,"
                " lost_reason=excluded.lost_reason, stop_reason=excluded.stop_reason,"
                " created_at=excluded.created_at, last_used_at=excluded.last_used_at,"
                " volume_name=excluded.volume_name, volume_id=excluded.volume_id",
                (rec.user_id, rec.chat_id, rec.container_id, rec.container_name, rec.image_id, rec.data_root_id,
                 rec.host_id, rec.state.value, rec.lost_reason, rec.stop_reason, rec.created_at.isoformat(),
                 rec.last_used_at.isoformat(), rec.volume_name, rec.volume_id))

        await self._write_sandbox(rec.user_id, rec.chat_id, q)

    async def _write_sandbox(self, user_id: str, chat_id: str, fn: Callable[[Conn], Awaitable[Any]]) -> None:
        try:
            await self._tx(fn)
        finally:
            self.sandbox_writes.wrote(user_id, chat_id)

    async def set_sandbox_state(self, user_id: str, chat_id: str, state: SandboxState,
                                lost_reason: str | None = None) -> None:
        await self._write_sandbox(user_id, chat_id, lambda conn: conn.execute(
            "UPDATE sandboxes SET state=%s, lost_reason=%s WHERE user_id=%s AND chat_id=%s",
            (state.value, lost_reason, user_id, chat_id)))

    async def set_stop_reason(self, user_id: str, chat_id: str, reason: str | None) -> None:
        await self._write_sandbox(user_id, chat_id, lambda conn: conn.execute(
            "UPDATE sandboxes SET stop_reason=%s WHERE user_id=%s AND chat_id=%s", (reason, user_id, chat_id)))

    async def touch_sandbox(self, user_id: str, chat_id: str) -> None:
        await self._write_sandbox(user_id, chat_id, lambda conn: conn.execute(
            "UPDATE sandboxes SET state=%s, last_used_at=%s WHERE user_id=%s AND chat_id=%s",
            (SandboxState.RUNNING.value, now().isoformat(), user_id, chat_id)))

    async def list_sandboxes(self, state: SandboxState | None = None) -> list[SandboxRecord]:
        async def q(conn: Conn) -> list[SandboxRecord]:
            if state is None:
                rows = await self._all(conn, "SELECT * FROM sandboxes")
            else:
                rows = await self._all(conn, "SELECT * FROM sandboxes WHERE state=%s", (state.value,))
            return [SandboxRecord(**r) for r in rows]

        return await self._tx(q)

    # -- members ----------------------------------------------------------------------------

    _MEMBER = "SELECT * FROM members WHERE user_id=%s AND chat_id=%s AND member_id=%s"

    async def get_member(self, user_id: str, chat_id: str, member_id: str) -> MemberRecord | None:
        async def q(conn: Conn) -> MemberRecord | None:
            row = await self._one(conn, self._MEMBER, (user_id, chat_id, member_id))
            return _SQLiteRows._member(row) if row else None

        return await self._tx(q)

    async def list_members(self, user_id: str, chat_id: str) -> list[MemberRecord]:
        async def q(conn: Conn) -> list[MemberRecord]:
            rows = await self._all(conn, "SELECT * FROM members WHERE user_id=%s AND chat_id=%s"
                                         " ORDER BY created_at, member_id", (user_id, chat_id))
            return [_SQLiteRows._member(r) for r in rows]

        return await self._tx(q)

    async def ensure_member(self, user_id: str, chat_id: str, member_id: str, runtime: str, *,
                            locator: SavedLocator | None = None, settled_turns: int = 0,
                            forked_from: str | None = None) -> MemberRecord:
        async def q(conn: Conn) -> MemberRecord:
            ts = now().isoformat()
            await conn.execute(
                "INSERT INTO members (user_id, chat_id, member_id, runtime, locator_id, locator_path,"
                " settled_turns, forked_from, created_at, updated_at) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (user_id, chat_id, member_id) DO NOTHING",
                (user_id, chat_id, member_id, runtime, locator.id if locator else None,
                 locator.path if locator else None, settled_turns, forked_from, ts, ts))
            row = await self._one(conn, self._MEMBER, (user_id, chat_id, member_id))
            assert row is not None
            return _SQLiteRows._member(row)

        return await self._tx(q)

    async def create_fork_member(self, source: MemberRecord, member_id: str, *, home_member_id: str,
                                 locator: SavedLocator | None, settled_turns: int,
                                 pending: PendingFork | None, where: VerifiedIn | None = None) -> MemberRecord | None:
        async def q(conn: Conn) -> MemberRecord | None:
            ts = now().isoformat()
            cur = await conn.execute(
                "INSERT INTO members (user_id, chat_id, member_id, runtime, locator_id, locator_path,"
                " settled_turns, forked_from, home_member_id, pending_fork, created_at, updated_at,"
                " last_container_id, last_image_id, last_cli_version)"
                " VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (user_id, chat_id, member_id) DO NOTHING",
                (source.user_id, source.chat_id, member_id, source.runtime, locator.id if locator else None,
                 locator.path if locator else None, settled_turns, source.member_id, home_member_id,
                 pending.model_dump_json() if pending else None, ts, ts,
                 *fork_where(source, where)))
            if cur.rowcount == 0:
                return None
            row = await self._one(conn, self._MEMBER, (source.user_id, source.chat_id, member_id))
            return _SQLiteRows._member(row) if row else None

        return await self._tx_once(q)

    async def mark_member_lost(self, user_id: str, chat_id: str, member_id: str, reason: str) -> None:
        await self._tx(lambda conn: conn.execute(
            "UPDATE members SET lost_reason=%s, updated_at=%s WHERE user_id=%s AND chat_id=%s AND member_id=%s"
            " AND lost_reason IS NULL", (reason, now().isoformat(), user_id, chat_id, member_id)))

    # -- jobs -------------------------------------------------------------------------------

    _JOB = "SELECT * FROM jobs WHERE user_id=%s AND job_id=%s"

    @staticmethod
    def _seen(job: JobRecord, body_digest: str) -> Claim:
        if job.body_digest != body_digest:
            return Claim("conflict", job)
        return Claim("done" if job.state == JobState.DONE else "running", job)

    async def claim_job(self, job_id: str, user_id: str, chat_id: str, member_id: str,
                        body_digest: str, owner: str, *, sync: bool = True, read_member: bool = False,
                        read_sandbox: bool = False) -> Claim:
        lease = self._lease  # ``sync`` aside: every commit of the daemon's store is synced
        after = self.sandbox_writes.now()

        async def q(conn: Conn) -> Claim:
            row = await self._one(conn, self._JOB, (user_id, job_id))
            if row is not None:
                return self._seen(JobRecord(**row), body_digest)
            await self._check_lease(conn)
            row = await self._one(
                conn,
                "INSERT INTO jobs (job_id, user_id, chat_id, member_id, body_digest, state, owner, created_at,"
                " host_id, host_epoch) VALUES (%s,%s,%s,%s,%s,%s,%s,%s,%s,%s)"
                " ON CONFLICT (user_id, job_id) DO NOTHING RETURNING *",
                (job_id, user_id, chat_id, member_id, body_digest, JobState.RUNNING.value, owner, now().isoformat(),
                 lease.host_id if lease else None, lease.epoch if lease else None))
            if row is not None:
                member = await self._one(conn, self._MEMBER, (user_id, chat_id, member_id)) if read_member else None
                sandbox = None
                if read_sandbox:
                    found = await self._one(conn, "SELECT * FROM sandboxes WHERE user_id=%s AND chat_id=%s",
                                            (user_id, chat_id))
                    sandbox = SeenSandbox(user_id, chat_id, SandboxRecord(**found) if found else None, after)
                return Claim("claimed", JobRecord(**row), _SQLiteRows._member(member) if member else None, sandbox)
            # a concurrent claim committed first (ON CONFLICT waited for it): its row is visible now
            row = await self._one(conn, self._JOB, (user_id, job_id))
            assert row is not None
            return self._seen(JobRecord(**row), body_digest)

        return await self._tx_once(q)

    async def get_job(self, user_id: str, job_id: str) -> JobRecord | None:
        async def q(conn: Conn) -> JobRecord | None:
            row = await self._one(conn, self._JOB, (user_id, job_id))
            return JobRecord(**row) if row else None

        return await self._tx(q)

    async def finish_job(self, user_id: str, job_id: str, receipt_json: str, member: MemberOutcome | None) -> None:
        """Receipt and member state in ONE transaction; retried while the server is away."""
        try:
            await self._finish(user_id, job_id, lambda conn: _decided(receipt_json, member))
        finally:
            self.sandbox_writes.wrote_some()  # the job's chat's sandbox: its last use

    async def settle_job(self, user_id: str, job_id: str, query: SettleQuery,
                         decide: Callable[[WireSettleView], tuple[str, MemberOutcome | None]], *,
                         sync: bool = True) -> None:
        """:meth:`finish_job` with the receipt decided inside the same transaction, from the
        ledger view its wire verdict reads (``sync=False`` too: the server answers a commit
        once it is durable)."""

        async def decided(conn: Conn) -> tuple[str, MemberOutcome | None]:
            return decide(await postgres_settle_view(conn, user_id, job_id, query))

        try:
            await self._finish(user_id, job_id, decided)
        finally:
            self.sandbox_writes.wrote(user_id, query.chat_id)  # the sandbox's last use

    async def _finish(self, user_id: str, job_id: str,
                      decided: Callable[[Conn], Awaitable[tuple[str, MemberOutcome | None]]]) -> None:
        attempt = 0
        ours: list[str] = []  # the receipts our attempts decided: an unacknowledged commit holds the last

        async def q(conn: Conn) -> None:
            row = await self._one(conn, self._JOB + " FOR UPDATE", (user_id, job_id))
            if row is None:
                raise KeyError(job_id)
            job = JobRecord(**row)
            if job.state == JobState.DONE:
                if attempt > 0 and ours and job.receipt_json == ours[-1]:
                    return  # our earlier attempt committed; its acknowledgement was lost
                await self._check_lease(conn)  # closed by another host because this one is fenced
                raise RuntimeError(f"job {job_id} already committed")  # never commit twice
            await self._check_lease(conn)  # a host that lost its lease never commits late
            receipt_json, member = await decided(conn)
            ours.append(receipt_json)
            ts = now().isoformat()
            await conn.execute("UPDATE jobs SET state=%s, receipt_json=%s, finished_at=%s WHERE user_id=%s"
                               " AND job_id=%s", (JobState.DONE.value, receipt_json, ts, user_id, job_id))
            if member is None:
                return
            if member.wire is not None:
                await postgres_put_turn(conn, member.wire)
            if member.keeper is not None:
                await postgres_put_keeper(conn, member.keeper)
            if member.verified is not None:
                v = member.verified
                loc, at = v.locator, v.where or VerifiedIn()
                await conn.execute(
                    "UPDATE members SET locator_id=%s, locator_path=%s, settled_turns=settled_turns+1,"
                    " last_status=%s, last_outcome=%s, pending_fork=NULL, updated_at=%s, last_container_id=%s,"
                    " last_image_id=%s, last_cli_version=%s WHERE user_id=%s AND chat_id=%s AND member_id=%s",
                    (loc.id, loc.path, member.last_status, member.last_outcome, ts, at.container_id, at.image_id,
                     at.cli_version, job.user_id, job.chat_id, job.member_id))
            else:
                await conn.execute(
                    "UPDATE members SET last_status=%s, last_outcome=%s, updated_at=%s WHERE user_id=%s"
                    " AND chat_id=%s AND member_id=%s",
                    (member.last_status, member.last_outcome, ts, job.user_id, job.chat_id, job.member_id))
            # the sandbox's last use, in the same transaction (no write of its own per turn)
            await conn.execute("UPDATE sandboxes SET last_used_at=%s WHERE user_id=%s AND chat_id=%s AND state=%s",
                               (ts, job.user_id, job.chat_id, SandboxState.RUNNING.value))

        deadline = time.monotonic() + self.commit_retry_s
        while True:
            try:
                return await self._tx_once(q)
            except StoreUnavailable as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("store.commit_retry", job_id=job_id, attempt=attempt, error=str(exc))
                attempt += 1
                await anyio.sleep(min(2.0, 0.2 * attempt))

    async def close_orphaned_job(self, user_id: str, job_id: str, receipt_json: str) -> bool:
        async def q(conn: Conn) -> bool:
            # lock order everywhere: the job row, then the host row (no deadlock with a commit)
            row = await self._one(conn, "SELECT host_id, host_epoch FROM jobs WHERE user_id=%s AND job_id=%s"
                                        " AND state=%s FOR UPDATE", (user_id, job_id, JobState.RUNNING.value))
            if row is None or row["host_id"] is None:
                return False
            await conn.execute(f"UPDATE hosts SET state='fenced' WHERE host_id=%s AND epoch=%s AND state='live'"
                               f" AND lease_until_ms <= {NOW_MS}", (row["host_id"], row["host_epoch"]))
            cur = await conn.execute(
                "UPDATE jobs SET state=%s, receipt_json=%s, finished_at=%s WHERE user_id=%s AND job_id=%s"
                " AND state=%s AND NOT EXISTS (SELECT 1 FROM hosts h WHERE h.host_id=jobs.host_id"
                " AND h.epoch=jobs.host_epoch AND h.state='live')",
                (JobState.DONE.value, receipt_json, now().isoformat(), user_id, job_id, JobState.RUNNING.value))
            return cur.rowcount == 1

        return await self._tx(q)

    async def running_jobs(self, *, not_owner: str | None = None, host_id: str | None = None) -> list[JobRecord]:
        async def q(conn: Conn) -> list[JobRecord]:
            rows = await self._all(conn, "SELECT * FROM jobs WHERE state=%s", (JobState.RUNNING.value,))
            return [JobRecord(**r) for r in rows if (not_owner is None or r["owner"] != not_owner)
                    and (host_id is None or r["host_id"] in (None, host_id))]

        return await self._tx(q)

    async def recent_receipts(self, user_id: str, chat_id: str, limit: int = 10) -> list[str]:
        async def q(conn: Conn) -> list[str]:
            rows = await self._all(conn, "SELECT receipt_json FROM jobs WHERE user_id=%s AND chat_id=%s AND state=%s"
                                         " AND deleted_at IS NULL ORDER BY finished_at DESC LIMIT %s",
                                   (user_id, chat_id, JobState.DONE.value, limit))
            return [r["receipt_json"] for r in rows]

        return await self._tx(q)
