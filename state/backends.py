"""Choose the store backend from ``CLOUD_AGENT_STORE_URL`` (SPEC 16)."""

from __future__ import annotations

from pathlib import Path

from state.contract import StoreContract

POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def validate_store_url(url: str | None) -> str | None:
    """None or empty: the embedded SQLite default. Else a PostgreSQL URL (error names the field)."""
    if not url:
        return None
    if not url.startswith(POSTGRES_SCHEMES):
        raise ValueError("store_url: must be a postgresql:// URL (unset = the embedded SQLite store)")
    return url


def open_store(url: str | None, sqlite_path: Path, *, sync_commits: bool = True) -> StoreContract:
    """The store object; call ``await store.open()`` before use (PostgreSQL connects and migrates).

    ``sync_commits=False`` (the model proxy service's wire records): a commit returns before it
    is on disk. Nothing a receipt depends on is lost that way: both backends keep one log
    written in commit order, and flushing it to a commit flushes everything before it too. A
    turn's records are committed before its receipt, whose commit waits for the disk (SQLite:
    the WAL's fsync by the store's flusher; PostgreSQL ``synchronous_commit=on``). Only records no
    durable commit followed can go with a power loss — those of a turn whose receipt went too."""
    if validate_store_url(url) is None:
        from state.store import Store

        return Store(sqlite_path, sync_commits=sync_commits)
    from state.postgres import PostgresStore

    return PostgresStore(url, sync_commits=sync_commits)  # type: ignore[arg-type]
