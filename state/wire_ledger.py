"""The wire ledger (SPEC 12): what the model proxy saw, per member, in the store.

Two tables (migration 6):

* ``wire_records`` — one row per request through the proxy: the record as JSON with digests
  only; ``capture_json`` holds message texts only when the operator turned capture on, and
  :meth:`purge_wire_capture` clears them after ``CLOUD_AGENT_WIRE_CAPTURE_DAYS``.
* ``wire_turns`` — one row per committed turn, written in the same transaction as its receipt
  (``state.contract.MemberOutcome.wire``): the baseline the turn leaves for the next one
  (digests) and, for a settled failure whose query reached the model, that query's text —
  the next turn's verdict needs it (a CLI may fold it into the next message); it is cleared
  by the next turn that settles successfully.

A record's digest is stored as its difference from an earlier record of its member
(``digest_parent``, migration 11; ``proxy.stored_digest``), and a turn's baseline as a
reference to its record (``baseline_record``). A turn's view therefore also carries the
records its records and baselines refer to (``ancestors``), except those the caller already
holds whole (``SettleQuery.known``): the usual turn reads none.

The store only keeps JSON it is given: the record and baseline types live in ``proxy``.
One SQL text serves both backends (``?`` placeholders; PostgreSQL gets ``%s``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class WireRecordRow:
    record_id: str
    user_id: str
    chat_id: str
    member_id: str | None
    job_id: str | None
    ordinal: str  # sorts records in arrival order, across proxy restarts
    record_json: str
    capture_json: str | None
    created_at: str
    digest_parent: str | None = None  # stored as a difference from this record (proxy.stored_digest)


@dataclass(frozen=True)
class WireTurnRow:
    user_id: str
    chat_id: str
    member_id: str
    job_id: str
    settled_index: int  # the member's settled turns once this turn committed
    outcome: str
    conversational: bool  # a conversational request of the turn reached the proxy
    baseline_json: str | None
    failed_text: str | None
    created_at: str
    baseline_record: str | None = None  # the record baseline_json refers to (proxy.stored_digest.BaselineRef)


_RECORD_COLUMNS = tuple(WireRecordRow.__dataclass_fields__)  # the table's columns, in the row's order
_INSERT_RECORD = (f"INSERT INTO wire_records ({', '.join(_RECORD_COLUMNS)})"
                  f" VALUES ({','.join('?' * len(_RECORD_COLUMNS))})")
_RECORD = "SELECT * FROM wire_records WHERE user_id=? AND chat_id=? AND record_id=?"
# a difference is stored only while its parent is: a chat deleted meanwhile (its id then begun
# again) leaves the proxy remembering a record the ledger no longer has
_INSERT_DIFFERENCE = (f"INSERT INTO wire_records ({', '.join(_RECORD_COLUMNS)})"
                      f" SELECT {','.join('?' * len(_RECORD_COLUMNS))} WHERE EXISTS ("
                      "SELECT 1 FROM wire_records WHERE user_id=? AND chat_id=? AND record_id=?)")
_RECORDS_OF_JOB = ("SELECT * FROM wire_records WHERE user_id=? AND chat_id=? AND job_id=? ORDER BY ordinal")
_INSERT_TURN = ("INSERT INTO wire_turns (user_id, chat_id, member_id, job_id, settled_index, outcome, conversational,"
                " baseline_json, failed_text, created_at, baseline_record) VALUES (?,?,?,?,?,?,?,?,?,?,?)")
_CLEAR_FAILED = ("UPDATE wire_turns SET failed_text=NULL WHERE user_id=? AND chat_id=? AND member_id=?"
                 " AND failed_text IS NOT NULL")
# What the next turn's verdict compares with (SPEC 12), read with the member's own index
# (wire_turns_by_member) in time independent of the chat's length: the last conversational turn's
# baseline and the failed queries since, never every turn the member ever had.
_MEMBER = "user_id=? AND chat_id=? AND member_id=? AND conversational=1"
_LAST_BASELINE = (f"SELECT baseline_json, baseline_record FROM wire_turns WHERE {_MEMBER} AND baseline_json IS NOT NULL"
                  " ORDER BY created_at DESC, job_id DESC LIMIT 1")
_ANY_TURN = f"SELECT 1 FROM wire_turns WHERE {_MEMBER} LIMIT 1"
# the trailing run of failed queries: failed texts with no later conversational turn that has none
# (a success clears them all, so the run is short)
_TRAILING_FAILED = (
    f"SELECT failed_text FROM wire_turns t WHERE {_MEMBER} AND failed_text IS NOT NULL AND NOT EXISTS ("
    "SELECT 1 FROM wire_turns s WHERE s.user_id=t.user_id AND s.chat_id=t.chat_id AND s.member_id=t.member_id"
    " AND s.conversational=1 AND s.failed_text IS NULL"
    " AND (s.created_at > t.created_at OR (s.created_at = t.created_at AND s.job_id > t.job_id)))"
    " ORDER BY created_at, job_id")
# a fork's first verdict: its source's last conversational turn at the fork point (its baseline or none)
_BASELINE_AT = (f"SELECT baseline_json, baseline_record FROM wire_turns WHERE {_MEMBER} AND settled_index <= ?"
                " ORDER BY created_at DESC, job_id DESC LIMIT 1")
_PURGE = "UPDATE wire_records SET capture_json=NULL WHERE capture_json IS NOT NULL AND created_at < ?"
_DELETE_CHAT = ("DELETE FROM wire_records WHERE user_id=? AND chat_id=?",
                "DELETE FROM wire_turns WHERE user_id=? AND chat_id=?")


@dataclass(frozen=True)
class WireExpectation:
    """A member's standing in the ledger for its next verdict."""

    conversational: bool  # any conversational turn of its own
    baseline_json: str | None  # of its last conversational turn that left one
    failed_texts: list[str]  # its failed queries since its last conversational turn without one, oldest first
    baseline_record: str | None = None  # the record that baseline refers to


@dataclass(frozen=True)
class WireSettleView:
    """What a turn's verdict reads, in one round trip: the job's records and its member's standing."""

    records: list[WireRecordRow]
    expectation: WireExpectation
    fork_baseline: str | None = None  # the fork source's baseline at the fork point (SettleQuery.fork_source)
    fork_baseline_record: str | None = None
    # the records the job's records and the baselines refer to, transitively, but SettleQuery.known
    ancestors: list[WireRecordRow] = field(default_factory=list)


@dataclass(frozen=True)
class SettleQuery:
    """Which view a turn's verdict reads inside its commit (``StoreContract.settle_job``)."""

    chat_id: str
    member_id: str | None  # None: the member has no record yet: the job's records alone
    # (source member id, settled index): a fork's source at the fork point, read only while the
    # member has no conversational turn of its own
    fork_source: tuple[str, int] | None = None
    # record id -> its whole digest, held by the caller: the view reads no ancestor past them
    # (the store reads the ids only)
    known: Mapping[str, Any] = field(default_factory=dict)


_NO_EXPECTATION = WireExpectation(False, None, [])
# StoreContract.wire_ancestors in one round trip: each seed's chain is walked with its ordinal;
# a record reached from several seeds counts for the first (the order the SQLite walk reads
# them in), so the limit keeps the same, nearest, records on both backends
_PG_ANCESTORS = """
WITH RECURSIVE chain(n, depth, record_id, digest_parent) AS (
    SELECT s.n, 1, w.record_id, w.digest_parent
      FROM unnest(%(seeds)s::text[]) WITH ORDINALITY AS s(record_id, n)
      JOIN wire_records w ON w.user_id = %(u)s AND w.chat_id = %(c)s AND w.record_id = s.record_id
     WHERE NOT (s.record_id = ANY(%(stop)s::text[]))
  UNION ALL
    SELECT c.n, c.depth + 1, w.record_id, w.digest_parent FROM chain c
      JOIN wire_records w ON w.user_id = %(u)s AND w.chat_id = %(c)s AND w.record_id = c.digest_parent
     WHERE NOT (c.digest_parent = ANY(%(stop)s::text[])) AND c.depth < %(limit)s),
nearest AS (SELECT DISTINCT ON (record_id) record_id, n, depth FROM chain ORDER BY record_id, n, depth)
SELECT w.* FROM nearest f JOIN wire_records w ON w.record_id = f.record_id
 ORDER BY f.n, f.depth LIMIT %(limit)s
"""
# a bound on the records one view reads back, far above what the proxy writes (a chain has at
# most proxy.stored_digest.KEYFRAME_DEPTH records)
MAX_ANCESTORS = 1024


def _record(row: Any) -> WireRecordRow:
    return WireRecordRow(**{k: row[k] for k in _RECORD_COLUMNS})


def _insert(row: WireRecordRow) -> tuple[str, tuple[Any, ...]]:
    params = tuple(getattr(row, k) for k in _RECORD_COLUMNS)
    if row.digest_parent is None:
        return _INSERT_RECORD, params
    return _INSERT_DIFFERENCE, (*params, row.user_id, row.chat_id, row.digest_parent)


def turn_params(turn: WireTurnRow) -> tuple[Any, ...]:
    return (turn.user_id, turn.chat_id, turn.member_id, turn.job_id, turn.settled_index, turn.outcome,
            int(turn.conversational), turn.baseline_json, turn.failed_text, turn.created_at, turn.baseline_record)


def _seeds(records: list[WireRecordRow], seen: set[str], *refs: str | None) -> list[str]:
    """What a view's records and baselines refer to that the view does not hold yet."""
    wanted = [*(r.digest_parent for r in records), *refs]
    return [w for w in wanted if w is not None and w not in seen]


def sqlite_ancestors(db: sqlite3.Connection, user_id: str, chat_id: str, seeds: Sequence[str],
                     stop: Collection[str], limit: int) -> list[WireRecordRow]:
    """``StoreContract.wire_ancestors`` on the store's thread (one read per record: SQLite's
    reads are local): each seed's chain in turn, from the seed back."""
    seen, out = set(stop), []
    for seed in seeds:
        rid: str | None = seed
        while rid is not None and rid not in seen and len(out) < limit:
            seen.add(rid)
            row = db.execute(_RECORD, (user_id, chat_id, rid)).fetchone()
            if row is None:
                break  # gone: nothing behind it
            out.append(_record(row))
            rid = out[-1].digest_parent
    return out


async def postgres_ancestors(conn: Any, user_id: str, chat_id: str, seeds: Sequence[str],
                             stop: Collection[str], limit: int) -> list[WireRecordRow]:
    """``StoreContract.wire_ancestors`` in one round trip (none without seeds)."""
    if not seeds or limit <= 0:
        return []
    cur = await conn.execute(_PG_ANCESTORS, {"u": user_id, "c": chat_id, "seeds": list(seeds),
                                             "stop": sorted(stop), "limit": limit})
    return [_record(r) for r in await cur.fetchall()]


def sqlite_put_turn(db: sqlite3.Connection, turn: WireTurnRow) -> None:
    """Inside ``finish_job``'s transaction (SQLite)."""
    if turn.outcome == "succeeded":
        db.execute(_CLEAR_FAILED, (turn.user_id, turn.chat_id, turn.member_id))
    db.execute(_INSERT_TURN, turn_params(turn))


async def postgres_put_turn(conn: Any, turn: WireTurnRow) -> None:
    """Inside ``finish_job``'s transaction (PostgreSQL)."""
    if turn.outcome == "succeeded":
        await conn.execute(_pg(_CLEAR_FAILED), (turn.user_id, turn.chat_id, turn.member_id))
    await conn.execute(_pg(_INSERT_TURN), turn_params(turn))


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


def _sqlite_expectation(db: sqlite3.Connection, key: tuple[str, str, str]) -> WireExpectation:
    if db.execute(_ANY_TURN, key).fetchone() is None:
        return WireExpectation(False, None, [])
    base = db.execute(_LAST_BASELINE, key).fetchone()
    failed = [r[0] for r in db.execute(_TRAILING_FAILED, key)]
    return WireExpectation(True, base[0] if base else None, failed, base[1] if base else None)


async def _postgres_expectation(conn: Any, key: tuple[str, str, str]) -> WireExpectation:
    if await (await conn.execute(_pg(_ANY_TURN), key)).fetchone() is None:
        return WireExpectation(False, None, [])
    base = await (await conn.execute(_pg(_LAST_BASELINE), key)).fetchone()
    failed = [r["failed_text"] for r in await (await conn.execute(_pg(_TRAILING_FAILED), key)).fetchall()]
    return WireExpectation(True, base["baseline_json"] if base else None, failed,
                           base["baseline_record"] if base else None)


def sqlite_settle_view(db: sqlite3.Connection, user_id: str, job_id: str, query: SettleQuery) -> WireSettleView:
    records = [_record(r) for r in db.execute(_RECORDS_OF_JOB, (user_id, query.chat_id, job_id))]
    if query.member_id is None:
        return WireSettleView(records, _NO_EXPECTATION)
    own = _sqlite_expectation(db, (user_id, query.chat_id, query.member_id))
    fork = fork_record = None
    if not own.conversational and query.fork_source is not None:
        row = db.execute(_BASELINE_AT, (user_id, query.chat_id, *query.fork_source)).fetchone()
        fork, fork_record = (row[0], row[1]) if row else (None, None)
    seen = {*query.known, *(r.record_id for r in records)}
    seeds = _seeds(records, seen, own.baseline_record, fork_record)
    ancestors = sqlite_ancestors(db, user_id, query.chat_id, seeds, seen, MAX_ANCESTORS)
    return WireSettleView(records, own, fork, fork_record, ancestors)


async def postgres_settle_view(conn: Any, user_id: str, job_id: str, query: SettleQuery) -> WireSettleView:
    cur = await conn.execute(_pg(_RECORDS_OF_JOB), (user_id, query.chat_id, job_id))
    records = [_record(r) for r in await cur.fetchall()]
    if query.member_id is None:
        return WireSettleView(records, _NO_EXPECTATION)
    own = await _postgres_expectation(conn, (user_id, query.chat_id, query.member_id))
    fork = fork_record = None
    if not own.conversational and query.fork_source is not None:
        row = await (await conn.execute(_pg(_BASELINE_AT), (user_id, query.chat_id, *query.fork_source))).fetchone()
        fork, fork_record = (row["baseline_json"], row["baseline_record"]) if row else (None, None)
    seen = {*query.known, *(r.record_id for r in records)}
    seeds = _seeds(records, seen, own.baseline_record, fork_record)  # none in the usual turn: no round trip
    ancestors = await postgres_ancestors(conn, user_id, query.chat_id, seeds, seen, MAX_ANCESTORS)
    return WireSettleView(records, own, fork, fork_record, ancestors)


class SQLiteWireLedger:
    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    def _tx(self, db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    async def put_wire_record(self, row: WireRecordRow) -> bool:
        sql, params = _insert(row)
        return await self._run(lambda db: self._tx(db, lambda d: d.execute(sql, params).rowcount == 1))

    async def wire_records_of_job(self, user_id: str, chat_id: str, job_id: str) -> list[WireRecordRow]:
        return await self._run(lambda db: [_record(r) for r in db.execute(_RECORDS_OF_JOB,
                                                                          (user_id, chat_id, job_id))])

    async def wire_ancestors(self, user_id: str, chat_id: str, seeds: list[str], *, stop: Collection[str] = (),
                             limit: int) -> list[WireRecordRow]:
        return await self._run(lambda db: sqlite_ancestors(db, user_id, chat_id, seeds, stop, limit))

    async def wire_expectation(self, user_id: str, chat_id: str, member_id: str) -> WireExpectation:
        return await self._run(lambda db: _sqlite_expectation(db, (user_id, chat_id, member_id)))

    async def wire_settle_view(self, user_id: str, job_id: str, query: SettleQuery) -> WireSettleView:
        return await self._run(lambda db: sqlite_settle_view(db, user_id, job_id, query))

    async def wire_baseline_at(self, user_id: str, chat_id: str, member_id: str, settled_index: int) -> str | None:
        def q(db: sqlite3.Connection) -> str | None:
            row = db.execute(_BASELINE_AT, (user_id, chat_id, member_id, settled_index)).fetchone()
            return row[0] if row else None

        return await self._run(q)

    async def purge_wire_capture(self, before: datetime) -> int:
        return await self._run(lambda db: self._tx(db, lambda d: d.execute(_PURGE, (before.isoformat(),)).rowcount))

    async def delete_wire_chat(self, user_id: str, chat_id: str) -> None:
        def q(db: sqlite3.Connection) -> None:
            for sql in _DELETE_CHAT:
                db.execute(sql, (user_id, chat_id))

        await self._run(lambda db: self._tx(db, q))


class PostgresWireLedger:
    async def _tx(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        raise NotImplementedError

    async def put_wire_record(self, row: WireRecordRow) -> bool:
        sql, params = _insert(row)

        async def q(conn: Any) -> bool:
            return (await conn.execute(_pg(sql), params)).rowcount == 1

        return await self._tx(q)

    async def wire_records_of_job(self, user_id: str, chat_id: str, job_id: str) -> list[WireRecordRow]:
        async def q(conn: Any) -> list[WireRecordRow]:
            cur = await conn.execute(_pg(_RECORDS_OF_JOB), (user_id, chat_id, job_id))
            return [_record(r) for r in await cur.fetchall()]

        return await self._tx(q)

    async def wire_ancestors(self, user_id: str, chat_id: str, seeds: list[str], *, stop: Collection[str] = (),
                             limit: int) -> list[WireRecordRow]:
        return await self._tx(lambda conn: postgres_ancestors(conn, user_id, chat_id, seeds, stop, limit))

    async def wire_expectation(self, user_id: str, chat_id: str, member_id: str) -> WireExpectation:
        return await self._tx(lambda conn: _postgres_expectation(conn, (user_id, chat_id, member_id)))

    async def wire_settle_view(self, user_id: str, job_id: str, query: SettleQuery) -> WireSettleView:
        return await self._tx(lambda conn: postgres_settle_view(conn, user_id, job_id, query))

    async def wire_baseline_at(self, user_id: str, chat_id: str, member_id: str, settled_index: int) -> str | None:
        async def q(conn: Any) -> str | None:
            cur = await conn.execute(_pg(_BASELINE_AT), (user_id, chat_id, member_id, settled_index))
            row = await cur.fetchone()
            return row["baseline_json"] if row else None

        return await self._tx(q)

    async def purge_wire_capture(self, before: datetime) -> int:
        async def q(conn: Any) -> int:
            cur = await conn.execute(_pg(_PURGE), (before.isoformat(),))
            return cur.rowcount

        return await self._tx(q)

    async def delete_wire_chat(self, user_id: str, chat_id: str) -> None:
        async def q(conn: Any) -> None:
            for sql in _DELETE_CHAT:
                await conn.execute(_pg(sql), (user_id, chat_id))

        await self._tx(q)
