"""Direct access to a store's database for tests (simulated damage, raw reads after a crash).

Its own short connection to the same database (SQLite file in WAL mode, or PostgreSQL): the
product's stores (:mod:`state.store`, :mod:`state.postgres`) carry no test-only methods.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from state.contract import now
from state.records import SandboxRecord, SandboxState

TABLES = ("sandboxes", "members", "jobs", "hosts", "placements", "wire_records", "wire_turns")


@contextmanager
def _connect(store: Any) -> Iterator[tuple[Any, str]]:
    """(connection, parameter placeholder) on the store's own database, in autocommit."""
    url = getattr(store, "url", None)
    if url is not None:  # PostgreSQL
        import psycopg
        from psycopg.rows import dict_row

        with psycopg.connect(url, row_factory=dict_row, autocommit=True) as conn:
            yield conn, "%s"
        return
    db = sqlite3.connect(str(store.path), isolation_level=None, timeout=30)
    db.row_factory = sqlite3.Row
    try:
        yield db, "?"
    finally:
        db.close()


def rows(store: Any, table: str) -> list[dict[str, Any]]:
    """Every row of one table, as committed."""
    if table not in TABLES:
        raise ValueError(f"unknown table {table!r}")
    with _connect(store) as (db, _):
        return [dict(r) for r in db.execute(f"SELECT * FROM {table}")]  # noqa: S608 - fixed names


def erase_locator(store: Any, user_id: str, chat_id: str, member_id: str) -> None:
    """Simulate a store that lost a member's locator (a LOST case)."""
    with _connect(store) as (db, p):
        db.execute(f"UPDATE members SET locator_id=NULL, locator_path=NULL WHERE user_id={p} AND chat_id={p}"
                   f" AND member_id={p}", (user_id, chat_id, member_id))


def lose_wire_record(store: Any, record_id: str) -> None:
    """Simulate a ledger that lost one record its children still refer to."""
    with _connect(store) as (db, p):
        db.execute(f"DELETE FROM wire_records WHERE record_id={p}", (record_id,))


def sandbox_record(**kw: object) -> SandboxRecord:
    """A running sandbox's record of chat ("u", "c"); ``kw`` overrides any field."""
    ts = now()
    base = dict(user_id="u", chat_id="c", container_id="C1", container_name="ca-x", image_id="sha256:A",
                data_root_id="R", host_id="h", state=SandboxState.RUNNING, created_at=ts, last_used_at=ts)
    return SandboxRecord(**{**base, **kw})
