"""The SQLite store's hosts, leases and placements (SPEC 16), a mixin of ``state.store.Store``.

Every lease is judged by the store's clock (:data:`NOW_MS`), never a caller's. SQLite
serialises writers (``BEGIN IMMEDIATE``), so a fence and a commit never interleave.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from typing import TypeVar

from state.contract import HostLease, HostRecord, Placement, now

T = TypeVar("T")

# The store's clock in milliseconds since the Unix epoch.
NOW_MS = "CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER)"


class SQLiteFleet:
    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    def _tx(self, db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    async def register_host(self, host_id: str, api_url: str, capacity: int, ttl_s: float) -> HostLease:
        """Join (or re-join) the fleet. A restart within the lease keeps the epoch (its chats
        stay); after the lease expired the host gets a new epoch and its old chats stay lost."""
        ttl_ms = int(ttl_s * 1000)

        def q(db: sqlite3.Connection) -> HostLease:
            ts = now().isoformat()
            row = db.execute(f"SELECT epoch, state, lease_until_ms > {NOW_MS} AS ok FROM hosts WHERE host_id=?",
                             (host_id,)).fetchone()
            if row is not None and row["state"] == "live" and row["ok"]:
                epoch = row["epoch"]
            else:
                epoch = (row["epoch"] + 1) if row is not None else 1
            db.execute(
                f"INSERT INTO hosts (host_id, api_url, capacity, epoch, state, lease_until_ms, registered_at,"
                f" renewed_at) VALUES (?,?,?,?,'live',{NOW_MS}+?,?,?) ON CONFLICT (host_id) DO UPDATE SET"
                f" api_url=excluded.api_url, capacity=excluded.capacity, epoch=excluded.epoch, state='live',"
                f" lease_until_ms=excluded.lease_until_ms, registered_at=excluded.registered_at,"
                f" renewed_at=excluded.renewed_at", (host_id, api_url, capacity, epoch, ttl_ms, ts, ts))
            until = db.execute("SELECT lease_until_ms FROM hosts WHERE host_id=?", (host_id,)).fetchone()[0]
            return HostLease(host_id=host_id, epoch=epoch, expires_ms=until)

        return await self._run(lambda db: self._tx(db, q))

    async def renew_lease(self, lease: HostLease, ttl_s: float) -> HostLease | None:
        """Extend a live lease; None once it expired or was superseded (then the host is fenced)."""

        def q(db: sqlite3.Connection) -> HostLease | None:
            row = db.execute(
                f"UPDATE hosts SET lease_until_ms={NOW_MS}+?, renewed_at=? WHERE host_id=? AND epoch=?"
                f" AND state='live' AND lease_until_ms > {NOW_MS} RETURNING lease_until_ms",
                (int(ttl_s * 1000), now().isoformat(), lease.host_id, lease.epoch)).fetchone()
            return None if row is None else HostLease(lease.host_id, lease.epoch, row[0])

        return await self._run(lambda db: self._tx(db, q))

    _HOSTS = (f"SELECT h.*, (h.state='live' AND h.lease_until_ms > {NOW_MS}) AS live,"
              " (SELECT COUNT(*) FROM placements p WHERE p.host_id=h.host_id AND p.host_epoch=h.epoch) AS placed"
              " FROM hosts h ORDER BY h.host_id")

    async def list_hosts(self) -> list[HostRecord]:
        def q(db: sqlite3.Connection) -> list[HostRecord]:
            return [HostRecord(host_id=r["host_id"], api_url=r["api_url"], capacity=r["capacity"], epoch=r["epoch"],
                               state=r["state"], lease_until_ms=r["lease_until_ms"], live=bool(r["live"]),
                               placed_chats=r["placed"]) for r in db.execute(self._HOSTS)]

        return await self._run(q)

    @staticmethod
    def _placement(db: sqlite3.Connection, user_id: str, chat_id: str) -> Placement | None:
        row = db.execute(
            f"SELECT p.*, h.api_url, h.epoch AS cur_epoch, h.state, h.lease_until_ms > {NOW_MS} AS ok"
            " FROM placements p LEFT JOIN hosts h ON h.host_id=p.host_id WHERE p.user_id=? AND p.chat_id=?",
            (user_id, chat_id)).fetchone()
        if row is None:
            return None
        live = row["cur_epoch"] == row["host_epoch"] and row["state"] == "live" and bool(row["ok"])
        if not live and row["state"] == "live" and row["cur_epoch"] == row["host_epoch"]:
            # an expired lease observed: fence that epoch for good (its commits are refused)
            db.execute(f"UPDATE hosts SET state='fenced' WHERE host_id=? AND epoch=? AND state='live'"
                       f" AND lease_until_ms <= {NOW_MS}", (row["host_id"], row["host_epoch"]))
        return Placement(user_id=user_id, chat_id=chat_id, host_id=row["host_id"], host_epoch=row["host_epoch"],
                         api_url=row["api_url"] or "", live=live)

    async def get_placement(self, user_id: str, chat_id: str) -> Placement | None:
        return await self._run(lambda db: self._tx(db, lambda d: self._placement(d, user_id, chat_id)))

    async def place_chat(self, user_id: str, chat_id: str) -> Placement | None:
        """The chat's owner; a new chat goes to the live host with the most free capacity.
        None: no live host."""

        def q(db: sqlite3.Connection) -> Placement | None:
            found = self._placement(db, user_id, chat_id)
            if found is not None:
                return found
            db.execute(
                f"INSERT INTO placements (user_id, chat_id, host_id, host_epoch, placed_at)"
                f" SELECT ?, ?, h.host_id, h.epoch, ? FROM hosts h WHERE h.state='live' AND h.lease_until_ms > {NOW_MS}"
                f" ORDER BY h.capacity - (SELECT COUNT(*) FROM placements p WHERE p.host_id=h.host_id"
                f" AND p.host_epoch=h.epoch) DESC, h.host_id LIMIT 1 ON CONFLICT (user_id, chat_id) DO NOTHING",
                (user_id, chat_id, now().isoformat()))
            return self._placement(db, user_id, chat_id)

        return await self._run(lambda db: self._tx(db, q))

