"""Keeper records (SPEC 14): each resident CLI's in-sandbox keeper, as the daemon last knew it.

One row per member: the keeper's identity (as it said it when it started), where it lives
in the sandbox, the driver session's snapshot, the last acknowledged output offset and the
turn in flight (its job, the driver's TurnStart and the offset where its output begins). A
restarted daemon re-adopts a keeper only when the keeper answers with exactly this identity.
Mixins of ``state.store.Store`` (SQLite) and ``state.postgres.PostgresStore``.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

T = TypeVar("T")


def now() -> datetime:
    return datetime.now(UTC)


class KeeperTurn(BaseModel):
    """The turn in flight on a keeper's CLI: enough for a new daemon to finish and commit it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_json: str  # the Job as dispatched (the wire ledger settles against its message)
    start_json: str  # the driver's TurnStart
    offset: int = Field(ge=0)  # keeper output offset where the turn's output begins
    context_status: str | None  # what the stream already said (LIVE / NEW / RESTORED)
    started_at: datetime
    timings_json: str  # the Timings measured before the turn (sandbox, process)


class KeeperNote(BaseModel):
    """A turn in flight as the keeper keeps it (its turn note, SPEC 14): written to the keeper
    before the turn's input instead of to the store, and read back from its hello by the next
    daemon. A keeper outlives what the machine outlives, as a commit the disk has not flushed."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    turn: KeeperTurn
    session: dict[str, Any]  # the driver session's snapshot as the turn began


class KeeperRecord(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    user_id: str
    chat_id: str
    member_id: str
    host_id: str
    runtime: str
    container_id: str
    run_dir: str  # the member's run dir in the sandbox (socket, pidfiles, log)
    identity: dict[str, Any]  # sandbox_manager.keeper_identity.KeeperIdentity, as the keeper said it
    session: dict[str, Any]  # the driver session's snapshot (drivers.session.NativeSession.snapshot)
    acked: int = Field(ge=0)  # output acknowledged to the keeper (everything before is committed)
    turn: KeeperTurn | None = None
    updated_at: datetime = Field(default_factory=now)


KEEPERS_SQL = """
CREATE TABLE keepers (
    user_id TEXT NOT NULL, chat_id TEXT NOT NULL, member_id TEXT NOT NULL, host_id TEXT NOT NULL,
    record_json TEXT NOT NULL, updated_at TEXT NOT NULL,
    PRIMARY KEY (user_id, chat_id, member_id)
);
CREATE INDEX keepers_by_host ON keepers (host_id)
"""


_UPSERT = ("INSERT INTO keepers (user_id, chat_id, member_id, host_id, record_json, updated_at)"
           " VALUES (?,?,?,?,?,?) ON CONFLICT (user_id, chat_id, member_id) DO UPDATE SET"
           " host_id=excluded.host_id, record_json=excluded.record_json, updated_at=excluded.updated_at")


def _upsert_params(rec: KeeperRecord) -> tuple[str, ...]:
    return (rec.user_id, rec.chat_id, rec.member_id, rec.host_id, rec.model_dump_json(), now().isoformat())


def sqlite_put_keeper(db: sqlite3.Connection, rec: KeeperRecord) -> None:
    """Inside a transaction (``finish_job``: the keeper between turns, committed with the receipt)."""
    db.execute(_UPSERT, _upsert_params(rec))


async def postgres_put_keeper(conn: Any, rec: KeeperRecord) -> None:
    await conn.execute(_UPSERT.replace("?", "%s"), _upsert_params(rec))


class SQLiteKeepers:
    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    def _tx(self, db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T], *, sync: bool = True) -> T:
        raise NotImplementedError

    async def put_keeper(self, rec: KeeperRecord, *, sync: bool = True) -> None:
        await self._run(lambda db: self._tx(db, lambda d: sqlite_put_keeper(d, rec), sync=sync))

    async def list_keepers(self, host_id: str) -> list[KeeperRecord]:
        def q(db: sqlite3.Connection) -> list[KeeperRecord]:
            rows = db.execute("SELECT record_json FROM keepers WHERE host_id=? ORDER BY user_id, chat_id, member_id",
                              (host_id,)).fetchall()
            return [KeeperRecord.model_validate_json(r[0]) for r in rows]

        return await self._run(q)

    async def delete_keeper(self, user_id: str, chat_id: str, member_id: str) -> None:
        def q(db: sqlite3.Connection) -> None:
            db.execute("DELETE FROM keepers WHERE user_id=? AND chat_id=? AND member_id=?",
                       (user_id, chat_id, member_id))

        await self._run(lambda db: self._tx(db, q))


class PostgresKeepers:
    async def _tx(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        raise NotImplementedError

    async def put_keeper(self, rec: KeeperRecord, *, sync: bool = True) -> None:
        await self._tx(lambda conn: postgres_put_keeper(conn, rec))  # every commit here is synced

    async def list_keepers(self, host_id: str) -> list[KeeperRecord]:
        async def q(conn: Any) -> list[KeeperRecord]:
            cur = await conn.execute("SELECT record_json FROM keepers WHERE host_id=%s"
                                     " ORDER BY user_id, chat_id, member_id", (host_id,))
            return [KeeperRecord.model_validate_json(r["record_json"]) for r in await cur.fetchall()]

        return await self._tx(q)

    async def delete_keeper(self, user_id: str, chat_id: str, member_id: str) -> None:
        async def q(conn: Any) -> None:
            await conn.execute("DELETE FROM keepers WHERE user_id=%s AND chat_id=%s AND member_id=%s",
                               (user_id, chat_id, member_id))

        await self._tx(q)
