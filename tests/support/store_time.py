"""Test-only: move a sandbox's last use back in time, straight in the daemon's SQLite store
(the product has no hook for it), so retention can be tested without waiting days."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime, timedelta
from pathlib import Path


def age_sandbox(store_path: Path, user_id: str, chat_id: str, days: float) -> datetime:
    """Set the sandbox's last_used_at to ``days`` ago; returns the new value."""
    when = datetime.now(UTC) - timedelta(days=days)
    db = sqlite3.connect(store_path, timeout=30)
    try:
        with db:
            cur = db.execute("UPDATE sandboxes SET last_used_at=? WHERE user_id=? AND chat_id=?",
                             (when.isoformat(), user_id, chat_id))
        assert cur.rowcount == 1, f"no sandbox recorded for {user_id}/{chat_id}"
    finally:
        db.close()
    return when
