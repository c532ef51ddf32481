"""The durable store: migrations, the job fence, the one-transaction commit rule."""

from __future__ import annotations

import sqlite3

import anyio
import pytest

from state.migrations import MIGRATIONS
from state.records import JobState
from state.store import MemberOutcome, SavedLocator, Store, VerifiedTurn

pytestmark = pytest.mark.anyio


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "s.db")
    yield s
    s.close()


async def test_migrations_are_versioned_and_idempotent(tmp_path) -> None:
    s = Store(tmp_path / "s.db")
    assert s.schema_version == len(MIGRATIONS)
    s.close()
    again = Store(tmp_path / "s.db")  # re-opening applies nothing twice
    assert again.schema_version == len(MIGRATIONS)
    assert again.raw_rows("members") == []
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


async def test_job_fence(store: Store) -> None:
    first = await store.claim_job("j1", "u", "c", "m", "digest-a", "owner-1")
    assert first.kind == "claimed"
    assert (await store.claim_job("j1", "u", "c", "m", "digest-a", "owner-2")).kind == "running"
    assert (await store.claim_job("j1", "u", "c", "m", "digest-b", "owner-2")).kind == "conflict"
    # job ids are scoped by user: another user's "j1" is a different, fresh job
    assert (await store.claim_job("j1", "other-user", "c", "m", "digest-b", "owner-2")).kind == "claimed"
    await store.ensure_member("u", "c", "m", "pi")
    await store.finish_job("u", "j1", '{"r": 1}', MemberOutcome("NEW", "succeeded", VerifiedTurn(SavedLocator(id="L1"))))
    done = await store.claim_job("j1", "u", "c", "m", "digest-a", "owner-2")
    assert done.kind == "done" and done.job.receipt_json == '{"r": 1}' and done.job.state == JobState.DONE
    with pytest.raises(RuntimeError, match="already committed"):
        await store.finish_job("u", "j1", '{"r": 2}', None)  # never commits twice


async def test_concurrent_claims_admit_exactly_one(store: Store) -> None:
    kinds: list[str] = []

    async def claim(i: int) -> None:
        kinds.append((await store.claim_job("same", "u", "c", "m", "d", f"o{i}")).kind)

    async with anyio.create_task_group() as tg:
        for i in range(16):
            tg.start_soon(claim, i)
    assert sorted(kinds) == ["claimed"] + ["running"] * 15


async def test_locator_moves_only_with_a_verified_turn(store: Store) -> None:
    await store.ensure_member("u", "c", "m", "claude")
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j1", "{}", MemberOutcome("NEW", "succeeded", VerifiedTurn(SavedLocator(id="A"))))
    for i, outcome in enumerate(["failed", "not_settled", "refused"], start=2):
        await store.claim_job(f"j{i}", "u", "c", "m", "d", "o")
        await store.finish_job("u", f"j{i}", "{}", MemberOutcome("LIVE", outcome, None))
    m = await store.get_member("u", "c", "m")
    assert (m.locator, m.settled_turns, m.last_outcome) == (SavedLocator(id="A"), 1, "refused")
    await store.claim_job("j9", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j9", "{}", MemberOutcome("RESTORED", "failed",
                                                     VerifiedTurn(SavedLocator(id="A", path="/p"))))
    m = await store.get_member("u", "c", "m")
    assert (m.locator, m.settled_turns) == (SavedLocator(id="A", path="/p"), 2)


async def test_failed_commit_leaves_nothing(store: Store) -> None:
    await store.ensure_member("u", "c", "m", "codex")
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    with pytest.raises(KeyError):
        await store.finish_job("u", "missing", "{}", MemberOutcome("NEW", "succeeded", VerifiedTurn(SavedLocator(id="X"))))
    m = await store.get_member("u", "c", "m")
    assert (m.locator, m.settled_turns) == (None, 0)
    assert store.raw_rows("jobs")[0]["state"] == "running"


async def test_lost_is_sticky_and_first_reason_wins(store: Store) -> None:
    await store.ensure_member("u", "c", "m", "pi")
    await store.mark_member_lost("u", "c", "m", "container_missing")
    await store.mark_member_lost("u", "c", "m", "something_else")
    assert (await store.get_member("u", "c", "m")).lost_reason == "container_missing"
