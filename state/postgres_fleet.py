"""The PostgreSQL store's hosts, leases and placements (SPEC 16), a mixin of
``state.postgres.PostgresStore``. Every lease is judged by the database's clock
(:data:`NOW_MS`), the one clock all hosts share.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
import psycopg
from psycopg.rows import dict_row

from state.contract import HostLease, HostRecord, Placement, StoreUnavailable, now

T = TypeVar("T")
Conn = psycopg.AsyncConnection[dict[str, Any]]

NOW_MS = "(extract(epoch from clock_timestamp()) * 1000)::bigint"
LEASE_CONNECT_TIMEOUT_S = 5


class PostgresFleet:
    url: str
    # The heartbeat's own connection, outside the pool: after a server restart the pool
    # hands out connections only after its reconnect backoff and a checkout wait of up to
    # its timeout, and ``_tx`` retries on top of that. Measured in CI: one renewal of a
    # 20 s lease blocked for 10 s behind the pool, the next came after the lease ran out
    # and the host fenced itself although the server had been back for seconds.
    _lease_conn: Conn | None = None

    async def _tx(self, fn: Callable[[Conn], Awaitable[T]]) -> T:
        raise NotImplementedError

    @staticmethod
    async def _one(conn: Conn, sql: str, params: tuple[Any, ...] = ()) -> dict[str, Any] | None:
        cur = await conn.execute(sql, params)
        return await cur.fetchone()

    @staticmethod
    async def _all(conn: Conn, sql: str, params: tuple[Any, ...] = ()) -> list[dict[str, Any]]:
        cur = await conn.execute(sql, params)
        return await cur.fetchall()

    async def register_host(self, host_id: str, api_url: str, capacity: int, ttl_s: float) -> HostLease:
        ttl_ms = int(ttl_s * 1000)

        async def q(conn: Conn) -> HostLease:
            ts = now().isoformat()
            row = await self._one(
                conn, f"INSERT INTO hosts (host_id, api_url, capacity, epoch, state, lease_until_ms, registered_at,"
                      f" renewed_at) VALUES (%s,%s,%s,1,'live',{NOW_MS}+%s,%s,%s) ON CONFLICT (host_id) DO NOTHING"
                      f" RETURNING epoch, lease_until_ms", (host_id, api_url, capacity, ttl_ms, ts, ts))
            if row is None:
                old = await self._one(conn, f"SELECT epoch, state, lease_until_ms > {NOW_MS} AS ok FROM hosts"
                                            f" WHERE host_id=%s FOR UPDATE", (host_id,))
                assert old is not None
                # a restart within the lease keeps the epoch (its chats stay); else a new epoch
                epoch = old["epoch"] if old["state"] == "live" and old["ok"] else old["epoch"] + 1
                row = await self._one(
                    conn, f"UPDATE hosts SET api_url=%s, capacity=%s, epoch=%s, state='live',"
                          f" lease_until_ms={NOW_MS}+%s, registered_at=%s, renewed_at=%s WHERE host_id=%s"
                          f" RETURNING epoch, lease_until_ms", (api_url, capacity, epoch, ttl_ms, ts, ts, host_id))
                assert row is not None
            return HostLease(host_id=host_id, epoch=int(row["epoch"]), expires_ms=int(row["lease_until_ms"]))

        return await self._tx(q)

    async def renew_lease(self, lease: HostLease, ttl_s: float) -> HostLease | None:
        """One attempt on the heartbeat's connection (the fleet's lease loop retries)."""
        try:
            if self._lease_conn is None or self._lease_conn.closed:
                self._lease_conn = await psycopg.AsyncConnection.connect(
                    self.url, autocommit=True, row_factory=dict_row, connect_timeout=LEASE_CONNECT_TIMEOUT_S)
            row = await self._one(
                self._lease_conn,
                f"UPDATE hosts SET lease_until_ms={NOW_MS}+%s, renewed_at=%s WHERE host_id=%s AND epoch=%s"
                f" AND state='live' AND lease_until_ms > {NOW_MS} RETURNING lease_until_ms",
                (int(ttl_s * 1000), now().isoformat(), lease.host_id, lease.epoch))
        except (psycopg.OperationalError, psycopg.InterfaceError) as exc:
            await self._drop_lease_conn()
            raise StoreUnavailable(f"store lease heartbeat: {type(exc).__name__}") from exc
        except BaseException:
            await self._drop_lease_conn()  # cancelled mid-exchange: the connection's state is unknown
            raise
        return None if row is None else HostLease(lease.host_id, lease.epoch, int(row["lease_until_ms"]))

    async def _drop_lease_conn(self) -> None:
        conn, self._lease_conn = self._lease_conn, None
        if conn is not None:
            with anyio.CancelScope(shield=True):
                await conn.close()

    async def list_hosts(self) -> list[HostRecord]:
        async def q(conn: Conn) -> list[HostRecord]:
            rows = await self._all(
                conn, f"SELECT h.*, (h.state='live' AND h.lease_until_ms > {NOW_MS}) AS live,"
                      " (SELECT COUNT(*) FROM placements p WHERE p.host_id=h.host_id AND p.host_epoch=h.epoch)"
                      " AS placed FROM hosts h ORDER BY h.host_id")
            return [HostRecord(host_id=r["host_id"], api_url=r["api_url"], capacity=r["capacity"],
                               epoch=int(r["epoch"]), state=r["state"], lease_until_ms=int(r["lease_until_ms"]),
                               live=bool(r["live"]), placed_chats=int(r["placed"])) for r in rows]

        return await self._tx(q)

    async def _placement(self, conn: Conn, user_id: str, chat_id: str) -> Placement | None:
        row = await self._one(
            conn, f"SELECT p.*, h.api_url, h.epoch AS cur_epoch, h.state, h.lease_until_ms > {NOW_MS} AS ok"
                  " FROM placements p LEFT JOIN hosts h ON h.host_id=p.host_id WHERE p.user_id=%s AND p.chat_id=%s",
            (user_id, chat_id))
        if row is None:
            return None
        same_epoch = row["cur_epoch"] == row["host_epoch"]
        live = same_epoch and row["state"] == "live" and bool(row["ok"])
        if not live and same_epoch and row["state"] == "live":
            # an expired lease observed: fence that epoch for good (its commits are refused)
            await conn.execute(f"UPDATE hosts SET state='fenced' WHERE host_id=%s AND epoch=%s AND state='live'"
                               f" AND lease_until_ms <= {NOW_MS}", (row["host_id"], row["host_epoch"]))
        return Placement(user_id=user_id, chat_id=chat_id, host_id=row["host_id"], host_epoch=int(row["host_epoch"]),
                         api_url=row["api_url"] or "", live=live)

    async def get_placement(self, user_id: str, chat_id: str) -> Placement | None:
        return await self._tx(lambda conn: self._placement(conn, user_id, chat_id))

    async def place_chat(self, user_id: str, chat_id: str) -> Placement | None:
        async def q(conn: Conn) -> Placement | None:
            found = await self._placement(conn, user_id, chat_id)
            if found is not None:
                return found
            await conn.execute(
                f"INSERT INTO placements (user_id, chat_id, host_id, host_epoch, placed_at)"
                f" SELECT %s, %s, h.host_id, h.epoch, %s FROM hosts h WHERE h.state='live'"
                f" AND h.lease_until_ms > {NOW_MS} ORDER BY h.capacity - (SELECT COUNT(*) FROM placements p"
                f" WHERE p.host_id=h.host_id AND p.host_epoch=h.epoch) DESC, h.host_id LIMIT 1"
                f" ON CONFLICT (user_id, chat_id) DO NOTHING", (user_id, chat_id, now().isoformat()))
            return await self._placement(conn, user_id, chat_id)

        return await self._tx(q)

