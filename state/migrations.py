"""Versioned schema migrations of the store, one list for both backends.

SQLite counts them in ``PRAGMA user_version``; PostgreSQL in its ``schema_version`` table
(``state.postgres``). A migration is appended, never edited: a store records how many it has
applied. Write portable SQL (the subset both dialects accept: TEXT, INTEGER, BIGINT, plain
CREATE/ALTER/INSERT ... SELECT): the same list migrates both.
"""

from __future__ import annotations

import sqlite3

from state.keepers import KEEPERS_SQL

MIGRATIONS: list[str] = [
    # 1: the first schema
    """
    CREATE TABLE sandboxes (
        user_id TEXT NOT NULL, chat_id TEXT NOT NULL,
        container_id TEXT NOT NULL, container_name TEXT NOT NULL, image_id TEXT NOT NULL,
        data_root_id TEXT NOT NULL, host_id TEXT NOT NULL,
        state TEXT NOT NULL, lost_reason TEXT,
        created_at TEXT NOT NULL, last_used_at TEXT NOT NULL,
        PRIMARY KEY (user_id, chat_id)
    );
    CREATE TABLE members (
        user_id TEXT NOT NULL, chat_id TEXT NOT NULL, member_id TEXT NOT NULL,
        runtime TEXT NOT NULL, locator_id TEXT, locator_path TEXT,
        settled_turns INTEGER NOT NULL DEFAULT 0, last_status TEXT, last_outcome TEXT,
        forked_from TEXT, created_at TEXT NOT NULL, updated_at TEXT NOT NULL,
        PRIMARY KEY (user_id, chat_id, member_id)
    );
    CREATE TABLE jobs (
        job_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, chat_id TEXT NOT NULL, member_id TEXT NOT NULL,
        body_digest TEXT NOT NULL, state TEXT NOT NULL, owner TEXT NOT NULL,
        receipt_json TEXT, created_at TEXT NOT NULL, finished_at TEXT
    );
    CREATE INDEX jobs_by_chat ON jobs (user_id, chat_id, finished_at);
    """,
    # 2: a LOST member stays LOST, independently of the status of its last turn
    """
    ALTER TABLE members ADD COLUMN lost_reason TEXT;
    """,
    # 3: forks — whose native home a member uses, and a fork the CLI makes at the first turn
    """
    ALTER TABLE members ADD COLUMN home_member_id TEXT;
    ALTER TABLE members ADD COLUMN pending_fork TEXT;
    """,
    # 4: job ids are scoped by user: another user's job id must be indistinguishable from a
    # fresh one (a global key answered "conflict", which revealed that the job exists)
    """
    CREATE TABLE jobs_v4 (
        user_id TEXT NOT NULL, job_id TEXT NOT NULL, chat_id TEXT NOT NULL, member_id TEXT NOT NULL,
        body_digest TEXT NOT NULL, state TEXT NOT NULL, owner TEXT NOT NULL,
        receipt_json TEXT, created_at TEXT NOT NULL, finished_at TEXT,
        PRIMARY KEY (user_id, job_id)
    );
    INSERT INTO jobs_v4 (user_id, job_id, chat_id, member_id, body_digest, state, owner, receipt_json,
                         created_at, finished_at)
        SELECT user_id, job_id, chat_id, member_id, body_digest, state, owner, receipt_json, created_at, finished_at
        FROM jobs;
    DROP TABLE jobs;
    ALTER TABLE jobs_v4 RENAME TO jobs;
    CREATE INDEX jobs_by_chat ON jobs (user_id, chat_id, finished_at);
    """,
    # 5: a fleet (SPEC 16) — hosts with a heartbeat lease whose epoch is the fencing token;
    # each chat placed on one host epoch; each job records the host epoch that claimed it
    """
    CREATE TABLE hosts (
        host_id TEXT PRIMARY KEY, api_url TEXT NOT NULL, capacity INTEGER NOT NULL,
        epoch BIGINT NOT NULL, state TEXT NOT NULL, lease_until_ms BIGINT NOT NULL,
        registered_at TEXT NOT NULL, renewed_at TEXT NOT NULL
    );
    CREATE TABLE placements (
        user_id TEXT NOT NULL, chat_id TEXT NOT NULL, host_id TEXT NOT NULL, host_epoch BIGINT NOT NULL,
        placed_at TEXT NOT NULL,
        PRIMARY KEY (user_id, chat_id)
    );
    CREATE INDEX placements_by_host ON placements (host_id, host_epoch);
    ALTER TABLE jobs ADD COLUMN host_id TEXT;
    ALTER TABLE jobs ADD COLUMN host_epoch BIGINT;
    """,
    # 6: the wire ledger (SPEC 12; state.wire_ledger) — digests per request and per turn;
    # message texts only with capture on (capture_json), failed queries until the next success
    """
    CREATE TABLE wire_records (
        record_id TEXT PRIMARY KEY, user_id TEXT NOT NULL, chat_id TEXT NOT NULL, member_id TEXT, job_id TEXT,
        ordinal TEXT NOT NULL, record_json TEXT NOT NULL, capture_json TEXT, created_at TEXT NOT NULL
    );
    CREATE INDEX wire_records_by_job ON wire_records (user_id, chat_id, job_id, ordinal);
    CREATE INDEX wire_records_by_age ON wire_records (created_at);
    CREATE TABLE wire_turns (
        user_id TEXT NOT NULL, chat_id TEXT NOT NULL, member_id TEXT NOT NULL, job_id TEXT NOT NULL,
        settled_index INTEGER NOT NULL, outcome TEXT NOT NULL, conversational INTEGER NOT NULL,
        baseline_json TEXT, failed_text TEXT, created_at TEXT NOT NULL,
        PRIMARY KEY (user_id, job_id)
    );
    CREATE INDEX wire_turns_by_member ON wire_turns (user_id, chat_id, member_id, created_at);
    """,
    # 7: why the daemon stopped a sandbox and keeps it stopped (disk_quota): it survives a restart
    """
    ALTER TABLE sandboxes ADD COLUMN stop_reason TEXT;
    """,
    # 8: deleted chats (state.chat_deletion) — a job of a deleted chat keeps a tombstone receipt,
    # and a later chat with the same id never lists it
    """
    ALTER TABLE jobs ADD COLUMN deleted_at TEXT;
    """,
    # 9: keepers (SPEC 14; state.keepers) — each resident's in-sandbox keeper: identity,
    # session snapshot, acknowledged offset, the turn in flight
    KEEPERS_SQL,
    # 10: state volumes (SPEC 15) — the chat's volume (name, id); where each member's native
    # state was last verified. Members settled before volumes existed were verified in the
    # sandbox's current container on its current image (their CLI version is not known).
    """
    ALTER TABLE sandboxes ADD COLUMN volume_name TEXT;
    ALTER TABLE sandboxes ADD COLUMN volume_id TEXT;
    ALTER TABLE members ADD COLUMN last_container_id TEXT;
    ALTER TABLE members ADD COLUMN last_image_id TEXT;
    ALTER TABLE members ADD COLUMN last_cli_version TEXT;
    UPDATE members SET
        last_container_id = (SELECT s.container_id FROM sandboxes s
                             WHERE s.user_id = members.user_id AND s.chat_id = members.chat_id),
        last_image_id = (SELECT s.image_id FROM sandboxes s
                         WHERE s.user_id = members.user_id AND s.chat_id = members.chat_id)
        WHERE settled_turns > 0;
    """,
    # 11: a wire record's digest stored as its difference from an earlier record of its member,
    # and a turn's baseline as its record's id (state.wire_ledger, proxy.stored_digest): the
    # ledger grew with the square of a chat's turns. Rows written before stay whole.
    """
    ALTER TABLE wire_records ADD COLUMN digest_parent TEXT;
    ALTER TABLE wire_turns ADD COLUMN baseline_record TEXT;
    """,
]


def migrate(db: sqlite3.Connection) -> None:
    """Apply every migration the store has not seen, each in its own transaction."""
    version = db.execute("PRAGMA user_version").fetchone()[0]
    for i, sql in enumerate(MIGRATIONS[version:], start=version + 1):
        db.execute("BEGIN IMMEDIATE")
        try:
            for stmt in filter(str.strip, sql.split(";")):
                db.execute(stmt)
            db.execute(f"PRAGMA user_version = {i}")
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise
