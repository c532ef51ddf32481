"""Deleting a chat's records (SPEC 10 ``DELETE /v1/users/{user_id}/chats/{chat_id}``), a mixin of
both stores.

One transaction removes the sandbox and member records (locators included), the wire ledger
(digests, captured texts, failed queries) and the chat's placement, and turns each finished
job's receipt into a tombstone (``state.receipts.tombstone``) marked ``deleted_at``: the job
fence keeps answering for those job ids, while a later chat with the same id lists none of
them. Running jobs are left alone: the caller cancelled the old chat's turns first, so a
job still running belongs to the chat that comes after the deletion.

Deleting twice is harmless: the second pass finds nothing left to delete.
One SQL text serves both backends (``?`` placeholders; PostgreSQL gets ``%s``).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from state.contract import ChatDeletion, now
from state.receipts import tombstone
from state.sandbox_writes import SandboxWrites

T = TypeVar("T")


_KNOWN = ("SELECT 1 FROM jobs WHERE user_id=? AND chat_id=?"
          " UNION ALL SELECT 1 FROM sandboxes WHERE user_id=? AND chat_id=?"
          " UNION ALL SELECT 1 FROM members WHERE user_id=? AND chat_id=? LIMIT 1")
_FINISHED = ("SELECT job_id, receipt_json FROM jobs WHERE user_id=? AND chat_id=? AND state='done'"
             " AND deleted_at IS NULL AND receipt_json IS NOT NULL")
_TOMBSTONE = "UPDATE jobs SET receipt_json=?, deleted_at=? WHERE user_id=? AND job_id=?"
_REMOVE = tuple(f"DELETE FROM {t} WHERE user_id=? AND chat_id=?"  # noqa: S608 - fixed names
                for t in ("wire_records", "wire_turns", "members", "sandboxes", "placements", "keepers"))


def _pg(sql: str) -> str:
    return sql.replace("?", "%s")


class SQLiteChatDeletion:
    sandbox_writes: SandboxWrites

    async def _run(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    def _tx(self, db: sqlite3.Connection, fn: Callable[[sqlite3.Connection], T]) -> T:
        raise NotImplementedError

    async def chat_known(self, user_id: str, chat_id: str) -> bool:
        """Any record of this chat, tombstones included (a deleted chat is still known)."""
        args = (user_id, chat_id) * 3
        return await self._run(lambda db: db.execute(_KNOWN, args).fetchone() is not None)

    async def delete_chat(self, user_id: str, chat_id: str) -> ChatDeletion:
        def q(db: sqlite3.Connection) -> ChatDeletion:
            at = now()
            rows = db.execute(_FINISHED, (user_id, chat_id)).fetchall()
            for job_id, receipt_json in rows:
                db.execute(_TOMBSTONE, (tombstone(receipt_json, at), at.isoformat(), user_id, job_id))
            removed = sum(db.execute(sql, (user_id, chat_id)).rowcount for sql in _REMOVE)
            return ChatDeletion(tombstoned=len(rows), removed=removed)

        try:
            return await self._run(lambda db: self._tx(db, q))
        finally:
            self.sandbox_writes.deleted(user_id, chat_id)


class PostgresChatDeletion:
    sandbox_writes: SandboxWrites

    async def _tx(self, fn: Callable[[Any], Awaitable[T]]) -> T:
        raise NotImplementedError

    async def chat_known(self, user_id: str, chat_id: str) -> bool:
        async def q(conn: Any) -> bool:
            cur = await conn.execute(_pg(_KNOWN), (user_id, chat_id) * 3)
            return await cur.fetchone() is not None

        return await self._tx(q)

    async def delete_chat(self, user_id: str, chat_id: str) -> ChatDeletion:
        async def q(conn: Any) -> ChatDeletion:
            at = now()
            # FOR UPDATE: a commit racing the deletion is ordered before or after it, never inside
            cur = await conn.execute(_pg(_FINISHED) + " FOR UPDATE", (user_id, chat_id))
            rows = await cur.fetchall()
            for row in rows:
                await conn.execute(_pg(_TOMBSTONE), (tombstone(row["receipt_json"], at), at.isoformat(), user_id,
                                                     row["job_id"]))
            removed = 0
            for sql in _REMOVE:
                removed += (await conn.execute(_pg(sql), (user_id, chat_id))).rowcount
            return ChatDeletion(tombstoned=len(rows), removed=removed)

        try:
            return await self._tx(q)
        finally:
            self.sandbox_writes.deleted(user_id, chat_id)
