"""The SQLite store: its migrations on disk (the shared contract: test_store_contract.py)."""

from __future__ import annotations

import sqlite3

import pytest

from state.migrations import MIGRATIONS
from state.records import JobState
from state.store import SavedLocator, Store
from tests.support.store import rows

pytestmark = pytest.mark.anyio


async def test_migrations_are_versioned_and_idempotent(tmp_path) -> None:
    s = Store(tmp_path / "s.db")
    assert s.schema_version == len(MIGRATIONS)
    s.close()
    again = Store(tmp_path / "s.db")  # re-opening applies nothing twice
    assert again.schema_version == len(MIGRATIONS)
    assert rows(again, "members") == []
    again.close()
    db = sqlite3.connect(tmp_path / "s.db")
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


async def test_upgrade_from_version_1_keeps_rows(tmp_path) -> None:
    path = tmp_path / "old.db"
    db = sqlite3.connect(path, isolation_level=None)
    for stmt in filter(str.strip, MIGRATIONS[0].split(";")):
        db.execute(stmt)
    db.execute("PRAGMA user_version = 1")
    db.execute("INSERT INTO members (user_id, chat_id, member_id, runtime, locator_id, settled_turns, created_at,"
               " updated_at) VALUES ('u','c','m','pi','loc',3,'2026-01-01T00:00:00+00:00','2026-01-01T00:00:00+00:00')")
    db.execute("INSERT INTO jobs VALUES ('j1','u','c','m','d','done','o','{}','2026-01-01T00:00:00+00:00',NULL)")
    db.close()
    s = Store(path)
    m = await s.get_member("u", "c", "m")
    assert (m.settled_turns, m.locator, m.lost_reason) == (3, SavedLocator(id="loc"), None)
    assert (m.home_member_id, m.pending_fork) == ("m", None)
    job = await s.get_job("u", "j1")
    assert (job.state, job.receipt_json) == (JobState.DONE, "{}")
    assert await s.get_job("other", "j1") is None
    s.close()

# The job fence, the commit rule and the host fence on both backends: test_store_contract.py


async def test_a_commit_without_sync_is_written_with_the_flush_off_and_the_flush_back_on_after(sqlite_store) -> None:
    store = sqlite_store
    """``sync=False`` (the job claim; a keeper's turn start): the transaction runs with
    ``synchronous=NORMAL`` (no fsync at its commit) and every later one with FULL again."""
    statements: list[str] = []
    store._db.set_trace_callback(statements.append)
    await store.claim_job("j1", "u", "c", "m", "d", "o", sync=False)
    await store.claim_job("j2", "u", "c", "m", "d", "o")
    store._db.set_trace_callback(None)
    shape = [s.split(" ")[0] if not s.startswith("PRAGMA") else s for s in statements]
    assert shape == ["PRAGMA synchronous=NORMAL", "BEGIN", "SELECT", "INSERT", "SELECT", "COMMIT",
                     "PRAGMA synchronous=FULL",
                     "BEGIN", "SELECT", "INSERT", "SELECT", "COMMIT"]
    assert store._db.execute("PRAGMA synchronous").fetchone()[0] == 2


async def test_a_commit_without_sync_survives_the_process_being_killed(tmp_path) -> None:
    """What ``sync=False`` keeps: a ``kill -9`` right after the commit loses nothing (the WAL
    holds it; only a crash of the machine before :meth:`Store.sync` could)."""
    import os
    import signal
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import os, signal, anyio
        from state.store import Store
        s = Store(__import__("pathlib").Path({str(tmp_path / "s.db")!r}))
        anyio.run(lambda: s.claim_job("j1", "u", "c", "m", "d", "o", sync=False))
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", code], cwd=os.getcwd(), capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    again = Store(tmp_path / "s.db")
    try:
        job = await again.get_job("u", "j1")
        assert job is not None and (job.state, job.owner) == (JobState.RUNNING, "o")
    finally:
        again.close()

