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


def open_store(url: str | None, sqlite_path: Path) -> StoreContract:
    """The store object; call ``await store.open()`` before use (PostgreSQL connects and migrates)."""
    if validate_store_url(url) is None:
        from state.store import Store

        return Store(sqlite_path)
    from state.postgres import PostgresStore

    return PostgresStore(url)  # type: ignore[arg-type]
