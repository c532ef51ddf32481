"""One store contract, two backends: every test here runs against SQLite (a file in tmp)
and PostgreSQL (a throwaway cluster the session starts itself, tests/support/postgres.py).

The job fence, the one-transaction commit rule, the host fence (lease epochs as fencing
tokens) and atomic placement, including races: many concurrent claims of one job id,
concurrent commits, a commit racing a fence.
"""

from __future__ import annotations

import anyio
import pytest

from state.contract import Fenced, HostLease, MemberOutcome, StoreContract, VerifiedIn, VerifiedTurn, now
from state.migrations import MIGRATIONS
from state.postgres import PostgresStore
from state.records import JobState, PendingFork, SandboxRecord, SandboxState, SavedLocator
from state.store import Store
from tests.support.store import rows, sandbox_record

pytestmark = [pytest.mark.anyio, pytest.mark.postgres]


@pytest.fixture(scope="session")
def pg():
    from tests.support.postgres import pg_cluster

    with pg_cluster() as cluster:
        yield cluster


@pytest.fixture(params=["sqlite", "postgres"])
async def store(request, tmp_path):
    if request.param == "sqlite":
        s: StoreContract = Store(tmp_path / "s.db")
    else:
        s = PostgresStore(request.getfixturevalue("pg").create_database())
    await s.open()
    yield s
    await s.aclose()
    if isinstance(s, PostgresStore):
        await anyio.to_thread.run_sync(request.getfixturevalue("pg").drop_database, s.url)


async def second_handle(store: StoreContract, tmp_path) -> StoreContract:
    """Another host's connection to the same store."""
    other = Store(tmp_path / "s.db") if isinstance(store, Store) else PostgresStore(store.url)
    await other.open()
    return other


async def expire_soon(store: StoreContract, lease: HostLease, ttl_s: float = 0.0) -> None:
    """Shorten a live lease to ``ttl_s`` from now (set-up under load must not race the expiry)."""
    assert await store.renew_lease(lease, ttl_s) is not None


def verified(loc: str) -> MemberOutcome:
    return MemberOutcome("NEW", "succeeded", VerifiedTurn(SavedLocator(id=loc)))


async def test_both_backends_implement_the_contract(store: StoreContract) -> None:
    assert isinstance(store, StoreContract)
    assert store.schema_version == len(MIGRATIONS)
    missing = [n for n in dir(StoreContract) if not n.startswith("_") and not hasattr(store, n)]
    assert missing == []


async def test_migrations_apply_once(store: StoreContract, tmp_path) -> None:
    again = await second_handle(store, tmp_path)  # re-opening applies nothing twice
    assert again.schema_version == len(MIGRATIONS)
    assert rows(again, "members") == []
    await again.aclose()


async def test_job_fence(store: StoreContract) -> None:
    first = await store.claim_job("j1", "u", "c", "m", "digest-a", "owner-1")
    assert first.kind == "claimed"
    assert (await store.claim_job("j1", "u", "c", "m", "digest-a", "owner-2")).kind == "running"
    assert (await store.claim_job("j1", "u", "c", "m", "digest-b", "owner-2")).kind == "conflict"
    # job ids are scoped by user: another user's "j1" is a different, fresh job
    assert (await store.claim_job("j1", "other-user", "c", "m", "digest-b", "owner-2")).kind == "claimed"
    await store.ensure_member("u", "c", "m", "pi")
    await store.finish_job("u", "j1", '{"r": 1}', verified("L1"))
    done = await store.claim_job("j1", "u", "c", "m", "digest-a", "owner-2")
    assert done.kind == "done" and done.job.receipt_json == '{"r": 1}' and done.job.state == JobState.DONE
    with pytest.raises(RuntimeError, match="already committed"):
        await store.finish_job("u", "j1", '{"r": 2}', None)  # never commits twice
    assert (await store.get_job("u", "j1")).receipt_json == '{"r": 1}'


async def test_a_claim_made_without_sync_fences_at_once_and_sync_returns(store: StoreContract, tmp_path) -> None:
    """``sync=False`` defers only the flush: another host's handle sees the claim at once."""
    assert (await store.claim_job("j1", "u", "c", "m", "d", "owner-1", sync=False)).kind == "claimed"
    other = await second_handle(store, tmp_path)
    try:
        assert (await other.claim_job("j1", "u", "c", "m", "d", "owner-2")).kind == "running"
    finally:
        await other.aclose()
    await store.sync()
    assert [(r["job_id"], r["owner"], r["state"]) for r in rows(store, "jobs")] == [("j1", "owner-1", "running")]


async def test_a_claim_reads_its_member_in_the_same_transaction(store: StoreContract) -> None:
    """``read_member``: the member as the claim saw it (None before its first turn); a repeat
    or a conflict reads none, and without the flag nothing is read."""
    first = await store.claim_job("j0", "u", "c", "m", "d", "o", read_member=True)
    assert (first.kind, first.member) == ("claimed", None)
    await store.ensure_member("u", "c", "m", "codex")
    await store.finish_job("u", "j0", '{"n": 0}', verified("L0"))
    claim = await store.claim_job("j1", "u", "c", "m", "d", "o", sync=False, read_member=True)
    assert claim.kind == "claimed" and claim.member is not None
    assert (claim.member.member_id, claim.member.runtime, claim.member.locator, claim.member.settled_turns) == (
        "m", "codex", SavedLocator(id="L0"), 1)
    assert claim.member == await store.get_member("u", "c", "m")
    assert (await store.claim_job("j1", "u", "c", "m", "d", "o", read_member=True)).member is None  # running
    assert (await store.claim_job("j1", "u", "c", "m", "x", "o", read_member=True)).member is None  # conflict
    assert (await store.claim_job("j2", "u", "c", "m", "d", "o")).member is None  # not asked


async def test_a_claim_reads_its_chats_sandbox_and_knows_when_that_read_went_stale(store: StoreContract) -> None:
    """``read_sandbox``: the chat's sandbox record as the claim's transaction saw it, current
    until a write of that chat's record returns (any of them, deletion and a settled turn's
    last use included); another chat's write leaves it current, a job finished without its
    chat named stales every read. A repeat reads nothing."""
    from state.wire_ledger import SettleQuery

    writes = store.sandbox_writes
    first = await store.claim_job("j0", "u", "c", "m", "d", "o", read_sandbox=True)
    assert (first.sandbox.user_id, first.sandbox.chat_id, first.sandbox.record) == ("u", "c", None)
    await store.put_sandbox(sandbox_record(volume_name="ca-x-home", volume_id="V1"))
    assert not writes.current(first.sandbox)  # the record was made after that claim read none

    async def claim(job: str):
        c = await store.claim_job(job, "u", "c", "m", "d", "o", sync=False, read_sandbox=True)
        assert c.kind == "claimed" and writes.current(c.sandbox)
        return c.sandbox

    seen = await claim("j1")
    assert seen.record == await store.get_sandbox("u", "c") and seen.record.volume_id == "V1"
    await store.put_sandbox(sandbox_record(chat_id="other"))
    await store.set_sandbox_state("u", "other", SandboxState.STOPPED)
    assert writes.current(seen)  # another chat's writes
    stale_after = [
        lambda: store.set_sandbox_state("u", "c", SandboxState.STOPPED),
        lambda: store.set_stop_reason("u", "c", "disk_quota"),
        lambda: store.touch_sandbox("u", "c"),
        lambda: store.put_sandbox(sandbox_record(container_id="C2")),
        lambda: store.settle_job("u", "j1", SettleQuery("c", None), lambda view: (_receipt("j1", "u", "c", "x"), None)),
        lambda: store.finish_job("u", "j2", _receipt("j2", "u", "other", "x"), None),  # chat not named: all
        lambda: store.delete_chat("u", "c"),
    ]
    await store.claim_job("j2", "u", "other", "m", "d", "o")
    for i, write in enumerate(stale_after):
        seen = await claim(f"k{i}")
        await write()
        assert not writes.current(seen), i
    assert (await claim("k9")).record is None  # the deletion removed it
    # and its count went with it: only "other" has one kept, until it is deleted too
    assert len(writes) == 1
    await store.delete_chat("u", "other")
    assert len(writes) == 0
    assert writes.current(await claim("k11"))
    assert (await store.claim_job("k9", "u", "c", "m", "d", "o", read_sandbox=True)).sandbox is None  # running
    assert (await store.claim_job("k10", "u", "c", "m", "d", "o")).sandbox is None  # not asked


async def test_many_concurrent_claims_of_one_job_admit_exactly_one(store: StoreContract, tmp_path) -> None:
    handles = [store] + [await second_handle(store, tmp_path) for _ in range(3)]  # four "hosts"
    kinds: list[str] = []

    async def claim(i: int) -> None:
        kinds.append((await handles[i % 4].claim_job("same", "u", "c", "m", "d", f"o{i}")).kind)

    async with anyio.create_task_group() as tg:
        for i in range(32):
            tg.start_soon(claim, i)
    for h in handles[1:]:
        await h.aclose()
    assert sorted(kinds) == ["claimed"] + ["running"] * 31
    assert len(rows(store, "jobs")) == 1


async def test_concurrent_commits_of_one_job_commit_once(store: StoreContract, tmp_path) -> None:
    await store.ensure_member("u", "c", "m", "codex")
    await store.claim_job("j", "u", "c", "m", "d", "o")
    handles = [store] + [await second_handle(store, tmp_path) for _ in range(3)]
    results: list[str] = []

    async def commit(i: int) -> None:
        try:
            await handles[i % 4].finish_job("u", "j", f'{{"n": {i}}}', verified(f"L{i}"))
            results.append(f"ok{i}")
        except RuntimeError:
            results.append("refused")

    async with anyio.create_task_group() as tg:
        for i in range(8):
            tg.start_soon(commit, i)
    for h in handles[1:]:
        await h.aclose()
    winners = [r for r in results if r.startswith("ok")]
    assert len(winners) == 1 and results.count("refused") == 7
    n = winners[0][2:]
    m = await store.get_member("u", "c", "m")
    assert (m.locator, m.settled_turns) == (SavedLocator(id=f"L{n}"), 1)
    assert (await store.get_job("u", "j")).receipt_json == f'{{"n": {n}}}'


async def test_commits_of_different_chats_run_concurrently(store: StoreContract) -> None:
    for i in range(10):
        await store.ensure_member("u", f"c{i}", "m", "pi")
        await store.claim_job(f"j{i}", "u", f"c{i}", "m", "d", "o")
    async with anyio.create_task_group() as tg:
        for i in range(10):
            tg.start_soon(store.finish_job, "u", f"j{i}", "{}", verified(f"L{i}"))
    for i in range(10):
        assert (await store.get_member("u", f"c{i}", "m")).locator == SavedLocator(id=f"L{i}")


async def test_locator_moves_only_with_a_verified_turn(store: StoreContract) -> None:
    await store.ensure_member("u", "c", "m", "claude")
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j1", "{}", verified("A"))
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


async def test_a_turns_commit_records_its_running_sandboxs_last_use(store: StoreContract) -> None:
    # issue 16: no store write of its own per turn for the sandbox's last use
    from datetime import UTC, datetime, timedelta

    old = datetime(2026, 1, 1, tzinfo=UTC)
    for chat, state in (("c", SandboxState.RUNNING), ("stopped", SandboxState.STOPPED)):
        await store.put_sandbox(SandboxRecord(user_id="u", chat_id=chat, container_id=f"id-{chat}",
                                              container_name=f"ca-{chat}", image_id="sha256:i", data_root_id="r",
                                              host_id="h", state=state, created_at=old, last_used_at=old))
        await store.ensure_member("u", chat, "m", "codex")
        await store.claim_job(f"j-{chat}", "u", chat, "m", "d", "o")
        await store.finish_job("u", f"j-{chat}", "{}", MemberOutcome("LIVE", "succeeded", None))
    running, stopped = await store.get_sandbox("u", "c"), await store.get_sandbox("u", "stopped")
    assert datetime.now(UTC) - running.last_used_at < timedelta(minutes=5)
    assert (running.state, stopped.state, stopped.last_used_at) == (SandboxState.RUNNING, SandboxState.STOPPED, old)
    await store.put_sandbox(running.model_copy(update={"last_used_at": old}))
    await store.claim_job("j-none", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j-none", "{}", None)  # a job closed without a member outcome touches nothing
    assert (await store.get_sandbox("u", "c")).last_used_at == old


async def test_failed_commit_leaves_nothing(store: StoreContract) -> None:
    await store.ensure_member("u", "c", "m", "codex")
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    with pytest.raises(KeyError):
        await store.finish_job("u", "missing", "{}", verified("X"))
    m = await store.get_member("u", "c", "m")
    assert (m.locator, m.settled_turns) == (None, 0)
    assert [r["state"] for r in rows(store, "jobs")] == ["running"]


async def test_lost_is_sticky_and_first_reason_wins(store: StoreContract) -> None:
    await store.ensure_member("u", "c", "m", "pi")
    await store.mark_member_lost("u", "c", "m", "container_missing")
    await store.mark_member_lost("u", "c", "m", "something_else")
    assert (await store.get_member("u", "c", "m")).lost_reason == "container_missing"


async def test_a_stop_reason_is_kept_until_cleared_and_survives_a_rewrite(store: StoreContract) -> None:
    from datetime import UTC, datetime

    from state.records import SandboxRecord, SandboxState

    ts = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    rec = SandboxRecord(user_id="u", chat_id="c", container_id="id1", container_name="ca-1", image_id="sha256:1",
                        data_root_id="dr", host_id="h", state=SandboxState.RUNNING, created_at=ts, last_used_at=ts)
    await store.put_sandbox(rec)
    assert (await store.get_sandbox("u", "c")).stop_reason is None
    await store.set_stop_reason("u", "c", "disk_quota")
    await store.set_sandbox_state("u", "c", SandboxState.STOPPED)
    got = await store.get_sandbox("u", "c")
    assert (got.state, got.stop_reason) == (SandboxState.STOPPED, "disk_quota")
    await store.put_sandbox(got)
    assert (await store.get_sandbox("u", "c")).stop_reason == "disk_quota"
    await store.set_stop_reason("u", "c", None)
    assert (await store.get_sandbox("u", "c")).stop_reason is None


# -- state volumes (SPEC 15) -------------------------------------------------------------------



async def test_sandbox_records_keep_their_volume(store: StoreContract) -> None:
    await store.put_sandbox(sandbox_record(volume_name="ca-x-home", volume_id="V1"))
    got = await store.get_sandbox("u", "c")
    assert (got.container_id, got.volume_name, got.volume_id) == ("C1", "ca-x-home", "V1")
    # a replacement container on the same volume rewrites the record in place
    await store.put_sandbox(got.model_copy(update={"container_id": "C2", "image_id": "sha256:B"}))
    got = await store.get_sandbox("u", "c")
    assert (got.container_id, got.image_id, got.volume_name, got.volume_id) == ("C2", "sha256:B", "ca-x-home", "V1")
    await store.put_sandbox(sandbox_record(chat_id="old"))  # made before volumes: no volume recorded
    assert ((await store.get_sandbox("u", "old")).volume_name, (await store.get_sandbox("u", "old")).volume_id) \
        == (None, None)


async def test_verified_turns_record_where_the_native_state_was_verified(store: StoreContract) -> None:
    await store.ensure_member("u", "c", "m", "claude")
    m = await store.get_member("u", "c", "m")
    assert (m.last_container_id, m.last_image_id, m.last_cli_version) == (None, None, None)
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j1", "{}", MemberOutcome("NEW", "succeeded", VerifiedTurn(
        SavedLocator(id="A"), VerifiedIn("C1", "sha256:A", "2.1.220"))))
    # a turn that verified nothing (refused, not settled) leaves them where they were
    await store.claim_job("j2", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j2", "{}", MemberOutcome("RESTORED", "not_settled", None))
    m = await store.get_member("u", "c", "m")
    assert (m.last_container_id, m.last_image_id, m.last_cli_version) == ("C1", "sha256:A", "2.1.220")
    lazy = await store.create_fork_member(m, "f", home_member_id="m", locator=None, settled_turns=1,
                                          pending=PendingFork(parent=SavedLocator(id="A")))
    assert (lazy.last_container_id, lazy.last_image_id, lazy.last_cli_version) == ("C1", "sha256:A", "2.1.220")
    eager = await store.create_fork_member(m, "g", home_member_id="g", locator=SavedLocator(id="G"),
                                           settled_turns=1, pending=None, where=VerifiedIn("C9", "sha256:Z", "9"))
    assert (eager.last_container_id, eager.last_image_id, eager.last_cli_version) == ("C9", "sha256:Z", "9")
    await store.claim_job("j3", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j3", "{}", MemberOutcome("RESTORED", "succeeded", VerifiedTurn(
        SavedLocator(id="A"), VerifiedIn("C2", "sha256:B", "2.1.332"))))
    m = await store.get_member("u", "c", "m")
    assert (m.last_container_id, m.last_image_id, m.last_cli_version, m.settled_turns) == \
        ("C2", "sha256:B", "2.1.332", 2)


def _volume_migration() -> int:
    return next(i for i, sql in enumerate(MIGRATIONS) if "ADD COLUMN volume_name" in sql)


async def test_the_volume_migration_backfills_members_settled_before_it(request, tmp_path, monkeypatch) -> None:
    """A store made before state volumes: its settled members were verified in the sandbox's
    current container on its current image; unsettled members and sandboxes get nothing."""
    before = _volume_migration()
    rows = [
        "INSERT INTO sandboxes (user_id, chat_id, container_id, container_name, image_id, data_root_id, host_id,"
        " state, created_at, last_used_at) VALUES ('u', 'c', 'C-old', 'ca-x', 'sha256:OLD', 'R', 'h', 'stopped',"
        " '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:00+00:00')",
        "INSERT INTO members (user_id, chat_id, member_id, runtime, locator_id, settled_turns, created_at,"
        " updated_at) VALUES ('u', 'c', 'm', 'codex', 'L', 3, '2026-01-01T00:00:00+00:00',"
        " '2026-01-01T00:00:00+00:00')",
        "INSERT INTO members (user_id, chat_id, member_id, runtime, settled_turns, created_at, updated_at)"
        " VALUES ('u', 'c', 'fresh', 'pi', 0, '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:00+00:00')",
    ]
    full = list(MIGRATIONS)
    for backend in ("sqlite", "postgres"):
        monkeypatch.setattr("state.migrations.MIGRATIONS", full[:before])
        monkeypatch.setattr("state.postgres.MIGRATIONS", full[:before])
        if backend == "sqlite":
            old: StoreContract = Store(tmp_path / "old.db")
        else:
            old = PostgresStore(request.getfixturevalue("pg").create_database())
        await old.open()
        assert old.schema_version == before
        url = getattr(old, "url", None)
        await old.aclose()
        _execute(tmp_path / "old.db" if url is None else url, rows)
        monkeypatch.setattr("state.migrations.MIGRATIONS", full)
        monkeypatch.setattr("state.postgres.MIGRATIONS", full)
        new: StoreContract = Store(tmp_path / "old.db") if url is None else PostgresStore(url)
        await new.open()
        try:
            assert new.schema_version == len(full), backend
            sb = await new.get_sandbox("u", "c")
            assert (sb.container_id, sb.volume_name, sb.volume_id) == ("C-old", None, None), backend
            m = await new.get_member("u", "c", "m")
            assert (m.last_container_id, m.last_image_id, m.last_cli_version) == ("C-old", "sha256:OLD", None), \
                backend
            f = await new.get_member("u", "c", "fresh")
            assert (f.last_container_id, f.last_image_id) == (None, None), backend
        finally:
            await new.aclose()
            if url is not None:
                await anyio.to_thread.run_sync(request.getfixturevalue("pg").drop_database, url)


def _execute(where: object, statements: list[str]) -> None:
    """Raw SQL on a store at an older schema (its own store methods expect the newest one)."""
    if isinstance(where, str):
        import psycopg

        with psycopg.connect(where) as conn:
            for stmt in statements:
                conn.execute(stmt)
    else:
        import sqlite3

        db = sqlite3.connect(str(where))
        with db:
            for stmt in statements:
                db.execute(stmt)
        db.close()


# -- hosts, leases, placement, fencing ----------------------------------------------------------


async def test_registration_epochs_are_fencing_tokens(store: StoreContract) -> None:
    a = await store.register_host("h1", "http://127.0.0.1:1", 10, ttl_s=30)
    assert a.epoch == 1
    again = await store.register_host("h1", "http://127.0.0.1:2", 10, ttl_s=30)
    assert again.epoch == 1  # a restart within the lease keeps the epoch (and its chats)
    short = await store.register_host("h2", "http://127.0.0.1:3", 10, ttl_s=0.2)
    await anyio.sleep(0.4)
    assert await store.renew_lease(short, ttl_s=30) is None  # expired: never renewed again
    back = await store.register_host("h2", "http://127.0.0.1:3", 10, ttl_s=30)
    assert back.epoch == 2
    assert await store.renew_lease(short, ttl_s=30) is None  # the old epoch is superseded
    assert (await store.renew_lease(back, ttl_s=30)).epoch == 2
    hosts = {h.host_id: h for h in await store.list_hosts()}
    assert (hosts["h1"].api_url, hosts["h1"].live, hosts["h2"].epoch) == ("http://127.0.0.1:2", True, 2)


async def test_placement_spreads_and_skips_dead_hosts(store: StoreContract) -> None:
    await store.register_host("h1", "http://a", 10, ttl_s=30)
    await store.register_host("h2", "http://b", 10, ttl_s=30)
    h3 = await store.register_host("h3", "http://c", 12, ttl_s=30)
    owners = [(await store.place_chat("u", f"c{i}")).host_id for i in range(4)]
    assert owners == ["h3", "h3", "h1", "h2"]  # most free capacity first; ties by host id
    assert (await store.place_chat("u", "c0")).host_id == "h3"  # placed once
    await expire_soon(store, h3)
    await anyio.sleep(0.1)  # h3's lease expired
    p = await store.get_placement("u", "c0")
    assert (p.host_id, p.live) == ("h3", False)
    assert {(await store.place_chat("u", f"n{i}")).host_id for i in range(4)} == {"h1", "h2"}
    back = await store.register_host("h3", "http://c", 12, ttl_s=30)
    assert back.epoch == 2
    p = await store.get_placement("u", "c0")
    assert (p.host_id, p.host_epoch, p.live) == ("h3", 1, False)  # its old chats stay lost
    assert [h.state for h in await store.list_hosts() if h.host_id == "h3"] == ["live"]


async def test_no_live_host_places_nothing(store: StoreContract) -> None:
    assert await store.place_chat("u", "c") is None
    assert await store.get_placement("u", "c") is None


async def test_concurrent_first_jobs_agree_on_one_owner(store: StoreContract, tmp_path) -> None:
    for h in ("h1", "h2", "h3"):
        await store.register_host(h, f"http://{h}", 10, ttl_s=30)
    handles = [store] + [await second_handle(store, tmp_path) for _ in range(2)]
    seen: list[str] = []

    async def place(i: int) -> None:
        seen.append((await handles[i % 3].place_chat("u", "contested")).host_id)

    async with anyio.create_task_group() as tg:
        for i in range(24):
            tg.start_soon(place, i)
    for h in handles[1:]:
        await h.aclose()
    assert len(seen) == 24 and len(set(seen)) == 1
    assert len([r for r in rows(store, "placements") if r["chat_id"] == "contested"]) == 1


async def test_a_bound_store_claims_and_commits_only_with_a_live_lease(store: StoreContract) -> None:
    lease = await store.register_host("h1", "http://a", 10, ttl_s=30)
    store.bind_lease(lease)
    await store.ensure_member("u", "c", "m", "codex")
    claim = await store.claim_job("j1", "u", "c", "m", "d", "o")
    assert (claim.kind, claim.job.host_id, claim.job.host_epoch) == ("claimed", "h1", 1)
    await expire_soon(store, lease)
    await anyio.sleep(0.1)  # the heartbeat stopped: the lease expired
    with pytest.raises(Fenced):
        await store.finish_job("u", "j1", '{"late": true}', verified("LATE"))
    with pytest.raises(Fenced):
        await store.claim_job("j2", "u", "c", "m", "d", "o")
    m = await store.get_member("u", "c", "m")
    assert (m.locator, m.settled_turns) == (None, 0)  # the late commit wrote nothing
    assert [(r["job_id"], r["state"]) for r in rows(store, "jobs")] == [("j1", "running")]
    # a live host closes the orphan; the fenced one can never commit it afterwards
    assert await store.close_orphaned_job("u", "j1", '{"closed": "host_lost"}') is True
    assert await store.close_orphaned_job("u", "j1", '{"again": 1}') is False
    assert (await store.get_job("u", "j1")).receipt_json == '{"closed": "host_lost"}'
    with pytest.raises(Fenced):
        await store.finish_job("u", "j1", '{"late": true}', verified("LATE"))


async def test_orphans_of_live_hosts_are_not_closed(store: StoreContract) -> None:
    store.bind_lease(await store.register_host("h1", "http://a", 10, ttl_s=30))
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    assert await store.close_orphaned_job("u", "j1", "{}") is False
    assert (await store.get_job("u", "j1")).state == JobState.RUNNING


async def test_a_commit_racing_a_fence_is_ordered(store: StoreContract, tmp_path) -> None:
    """A commit and another host's fencing of that epoch: either the commit wins (and the
    orphan close finds it done) or the fence wins (and the commit writes nothing). Never both."""
    other = await second_handle(store, tmp_path)
    outcomes = []
    for i in range(12):
        lease = await store.register_host(f"r{i}", "http://r", 10, ttl_s=30)
        store.bind_lease(lease)
        await store.ensure_member("u", f"c{i}", "m", "pi")
        await store.claim_job(f"j{i}", "u", f"c{i}", "m", "d", "o")
        await expire_soon(store, lease, ttl_s=0.01 * (i % 4))  # the race starts right at the lease's end
        result: dict[str, object] = {}

        async def commit(i: int = i, result: dict[str, object] = result) -> None:
            try:
                await store.finish_job("u", f"j{i}", '{"by": "owner"}', verified(f"L{i}"))
                result["commit"] = True
            except Fenced:
                result["commit"] = False

        async def close(i: int = i, result: dict[str, object] = result) -> None:
            result["close"] = await other.close_orphaned_job("u", f"j{i}", '{"by": "fence"}')

        async with anyio.create_task_group() as tg:
            tg.start_soon(commit)
            tg.start_soon(close)
        job = await store.get_job("u", f"j{i}")
        m = await store.get_member("u", f"c{i}", "m")
        assert not (result["commit"] and result["close"]), result  # never both
        if not result["commit"] and not result["close"]:
            # the close ran while the lease was still live, the commit after it expired:
            # nothing was written, and a later close succeeds
            assert job.state == JobState.RUNNING
            assert await other.close_orphaned_job("u", f"j{i}", '{"by": "fence"}') is True
            job = await store.get_job("u", f"j{i}")
        if result["commit"]:
            assert (job.receipt_json, m.locator) == ('{"by": "owner"}', SavedLocator(id=f"L{i}"))
        else:
            assert (job.receipt_json, m.locator) == ('{"by": "fence"}', None)
        outcomes.append(result["commit"])
    store.bind_lease(None)
    await other.aclose()
    assert len(outcomes) == 12


async def test_postgres_outage_is_store_unavailable_and_short_ones_are_ridden_out(request) -> None:
    from state.contract import StoreUnavailable

    pg = request.getfixturevalue("pg")
    url = pg.create_database()
    patient = PostgresStore(url, retry_s=30)
    impatient = PostgresStore(url, retry_s=0.5, timeout_s=2)
    await patient.open()
    await impatient.open()
    await patient.ensure_member("u", "c", "m", "pi")
    try:
        await anyio.to_thread.run_sync(pg.stop)
        with pytest.raises(StoreUnavailable, match="store postgresql://cloud_agent@"):
            await impatient.get_member("u", "c", "m")
        with pytest.raises(StoreUnavailable):
            await impatient.claim_job("j", "u", "c", "m", "d", "o")  # a claim is never retried blindly
        async with anyio.create_task_group() as tg:
            seen: list[object] = []

            async def read() -> None:
                seen.append(await patient.get_member("u", "c", "m"))  # waits out the restart

            tg.start_soon(read)
            await anyio.sleep(1.0)
            await anyio.to_thread.run_sync(pg.start)
        assert [m.member_id for m in seen] == ["m"]
        # The impatient pool reconnects on its own backoff after the outage (a CI run under load
        # still had none after its 2 s): a claim that got no connection sent nothing, so asking
        # again is safe — and one that had committed would answer "running", failing below.
        with anyio.fail_after(30):
            while True:
                try:
                    claim = await impatient.claim_job("j", "u", "c", "m", "d", "o")
                    break
                except StoreUnavailable as exc:
                    assert "PoolTimeout" in str(exc), exc
                    await anyio.sleep(0.2)
        assert claim.kind == "claimed"
        assert [r["job_id"] for r in rows(patient, "jobs")] == ["j"]
    finally:
        if not (pg.root / "data" / "postmaster.pid").exists():
            await anyio.to_thread.run_sync(pg.start)
        await patient.aclose()
        await impatient.aclose()


async def test_postgres_lease_heartbeat_fails_fast_in_an_outage_and_renews_once_the_server_is_back(request) -> None:
    """One attempt on its own connection: no pool checkout wait, no retry loop (those took
    10 s of a 20 s lease in CI); the fleet's lease loop does the retrying."""
    from state.contract import StoreUnavailable

    pg = request.getfixturevalue("pg")
    store = PostgresStore(pg.create_database())  # the daemon's pool settings: 10 s checkout, 10 s retry
    await store.open()
    lease = await store.register_host("h", "http://127.0.0.1:1", 1, ttl_s=120)
    assert await store.renew_lease(lease, 120) is not None
    try:
        await anyio.to_thread.run_sync(pg.stop)
        errors = []
        for _ in range(2):  # its connection was shut down; then no server to connect to
            t = anyio.current_time()
            with pytest.raises(StoreUnavailable, match="^store lease heartbeat: ") as exc:
                await store.renew_lease(lease, 120)
            assert anyio.current_time() - t < 3.0
            errors.append(str(exc.value))
        assert errors == ["store lease heartbeat: AdminShutdown", "store lease heartbeat: OperationalError"]
        await anyio.to_thread.run_sync(pg.start)
        t = anyio.current_time()
        renewed = await store.renew_lease(lease, 120)
        assert renewed is not None and renewed.epoch == lease.epoch and anyio.current_time() - t < 3.0
    finally:
        if not (pg.root / "data" / "postmaster.pid").exists():
            await anyio.to_thread.run_sync(pg.start)
        await store.aclose()


# -- deleting a chat ------------------------------------------------------------------------------


def _receipt(job_id: str, user: str, chat: str, text: str) -> str:
    from datetime import UTC, datetime

    from state.receipts import Receipt

    ts = datetime.now(UTC)
    return Receipt.model_validate({
        "job_id": job_id, "user_id": user, "chat_id": chat, "member_id": "m", "runtime": "claude",
        "context_status": "NEW", "outcome": "succeeded", "locator_before": None, "locator_after": "L-1",
        "settlement": {"evidence": "result", "is_error": False, "detail": f"said {text}",
                       "raw": [{"type": "result", "result": text}]},
        "assistant_text": text, "timings_ms": {"sandbox": 1, "process": 2, "turn": 3, "total": 7},
        "wire": {"requests": 2, "side_requests": 1, "history": "gap",
                 "first_difference": {"index": 0, "role": "user", "expected_digest": "e" * 64}},
        "started_at": ts, "finished_at": ts}).model_dump_json()


async def _chat_with_everything(store: StoreContract, user: str, chat: str, text: str) -> None:
    from datetime import UTC, datetime

    from state.records import SandboxRecord, SandboxState
    from state.wire_ledger import WireRecordRow, WireTurnRow

    ts = datetime.now(UTC)
    await store.put_sandbox(SandboxRecord(user_id=user, chat_id=chat, container_id=f"cid-{user}",
                                          container_name=f"n-{user}", image_id="img", data_root_id="root",
                                          host_id="h", state=SandboxState.RUNNING, created_at=ts, last_used_at=ts))
    await store.ensure_member(user, chat, "m", "claude")
    job = f"j-{user}"
    await store.claim_job(job, user, chat, "m", "d", "o")
    turn = WireTurnRow(user, chat, "m", job, 1, "failed", True, '{"digests": []}', f"query {text}", ts.isoformat())
    await store.finish_job(user, job, _receipt(job, user, chat, text),
                           MemberOutcome("NEW", "succeeded", VerifiedTurn(SavedLocator(id="L-1")), wire=turn))
    await store.put_wire_record(WireRecordRow(f"r-{user}", user, chat, "m", job, "0001", "{}",
                                              f'["{text}"]', ts.isoformat()))
    await store.register_host("h", "http://127.0.0.1:1", 10, ttl_s=30)
    assert await store.place_chat(user, chat) is not None


def _rows_of(store: StoreContract, user: str) -> dict[str, int]:
    return {t: sum(1 for r in rows(store, t) if r["user_id"] == user)
            for t in ("sandboxes", "members", "wire_records", "wire_turns", "placements")}


async def test_delete_chat_keeps_tombstones_only_and_touches_no_other_chat(store: StoreContract) -> None:
    from state.receipts import Receipt

    await _chat_with_everything(store, "u1", "c", "secret reply one")
    await store.claim_job("j-other-chat", "u1", "c2", "m", "d", "o")
    await _chat_with_everything(store, "u2", "c", "reply of user two")
    assert _rows_of(store, "u1") == {"sandboxes": 1, "members": 1, "wire_records": 1, "wire_turns": 1,
                                     "placements": 1}

    done = await store.delete_chat("u1", "c")
    assert (done.tombstoned, done.removed) == (1, 5)
    assert _rows_of(store, "u1") == {"sandboxes": 0, "members": 0, "wire_records": 0, "wire_turns": 0,
                                     "placements": 0}
    assert "secret reply one" not in repr([rows(store, t) for t in ("jobs", "wire_records", "wire_turns")])
    rec = await store.get_job("u1", "j-u1")
    assert rec is not None and rec.deleted_at is not None and rec.state == JobState.DONE
    tomb = Receipt.model_validate_json(rec.receipt_json)
    assert (tomb.job_id, tomb.context_status, tomb.outcome, tomb.timings_ms.total) == ("j-u1", "NEW", "succeeded", 7)
    assert (tomb.assistant_text, tomb.settlement.detail, tomb.settlement.raw) == ("", None, [])
    assert (tomb.locator_after, tomb.wire.history, tomb.wire.first_difference) == (None, "gap", None)
    assert tomb.deleted_at == rec.deleted_at
    # the job fence still answers for the old job id; a new chat of that id lists none of it
    assert (await store.claim_job("j-u1", "u1", "c", "m", "d", "o")).kind == "done"
    assert await store.recent_receipts("u1", "c") == []
    assert await store.chat_known("u1", "c") and not await store.chat_known("u1", "never")
    # the same chat id of another user, and another chat of this user: untouched
    assert _rows_of(store, "u2") == {"sandboxes": 1, "members": 1, "wire_records": 1, "wire_turns": 1,
                                     "placements": 1}
    assert "reply of user two" in (await store.recent_receipts("u2", "c"))[0]
    assert (await store.get_job("u1", "j-other-chat")).state == JobState.RUNNING

    again = await store.delete_chat("u1", "c")
    assert (again.tombstoned, again.removed) == (0, 0)
    assert Receipt.model_validate_json((await store.get_job("u1", "j-u1")).receipt_json) == tomb


async def test_keeper_records_per_member_and_host(store: StoreContract) -> None:
    from state.keepers import KeeperRecord, KeeperTurn

    def rec(member: str, host: str, acked: int, turn: KeeperTurn | None = None) -> KeeperRecord:
        return KeeperRecord(user_id="u", chat_id="c", member_id=member, host_id=host, runtime="codex",
                            container_id="cid", run_dir=f"/home/agent/members/{member}/run",
                            identity={"keeper_id": "k" * 32, "pid": 7, "start_time": 99, "member": member, "tags": {}},
                            session={"turns": 1, "thread_id": "t-1"}, acked=acked, turn=turn)

    turn = KeeperTurn(job_json='{"job_id":"j1"}', start_json='{"turn":2}', offset=40, context_status="LIVE",
                      started_at=now(), timings_json='{"sandbox":1,"process":2,"turn":0,"total":0}')
    await store.put_keeper(rec("m1", "h1", 10))
    await store.put_keeper(rec("m2", "h2", 5))
    await store.put_keeper(rec("m1", "h1", 40, turn))  # the same member: replaced, not added
    assert [(r.member_id, r.acked, r.turn) for r in await store.list_keepers("h1")] == [("m1", 40, turn)]
    assert [r.member_id for r in await store.list_keepers("h2")] == ["m2"]
    await store.delete_keeper("u", "c", "m1")
    await store.delete_keeper("u", "c", "m1")  # idempotent
    assert await store.list_keepers("h1") == []
    assert [r.identity["pid"] for r in await store.list_keepers("h2")] == [7]


async def test_a_turns_commit_records_its_keeper_between_turns_in_the_same_transaction(store: StoreContract) -> None:
    """The keeper's between-turns record (no turn, output acknowledged to the turn's end) is
    written by the commit itself; a commit that is refused (the job already committed) writes
    no keeper record either."""
    from state.keepers import KeeperRecord, KeeperTurn

    def rec(acked: int, turn: KeeperTurn | None) -> KeeperRecord:
        return KeeperRecord(user_id="u", chat_id="c", member_id="m", host_id="h1", runtime="codex",
                            container_id="cid", run_dir="/home/agent/members/m/run",
                            identity={"keeper_id": "k" * 32, "pid": 7, "start_time": 99, "member": "m", "tags": {}},
                            session={"turns": 1, "thread_id": "t-1"}, acked=acked, turn=turn)

    turn = KeeperTurn(job_json='{"job_id":"j1"}', start_json='{"turn":1}', offset=40, context_status="LIVE",
                      started_at=now(), timings_json='{"sandbox":1,"process":2,"turn":0,"total":0}')
    await store.ensure_member("u", "c", "m", "codex")
    await store.put_keeper(rec(40, turn))  # the turn began at offset 40
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    await store.finish_job("u", "j1", _receipt("j1", "u", "c", "one"),
                           MemberOutcome("LIVE", "succeeded", VerifiedTurn(SavedLocator(id="L-1")), keeper=rec(95, None)))
    assert [(r.acked, r.turn) for r in await store.list_keepers("h1")] == [(95, None)]
    with pytest.raises(RuntimeError):  # never committed twice, and nothing of the second attempt is kept
        await store.finish_job("u", "j1", _receipt("j1", "u", "c", "two"),
                               MemberOutcome("LIVE", "succeeded", keeper=rec(120, turn)))
    assert [(r.acked, r.turn) for r in await store.list_keepers("h1")] == [(95, None)]


def _reference_expectation(turns: list[dict], member: str) -> tuple[bool, str | None, list[str]]:
    """The verdict's expectation as it was computed from every turn of the member (before
    wire_expectation read only what it needs): the reference the queries must equal."""
    own = sorted((t for t in turns if t["member_id"] == member and t["conversational"]),
                 key=lambda t: (t["created_at"], t["job_id"]))
    failed: list[str] = []
    for t in reversed(own):
        if t["failed_text"] is None:
            break
        failed.insert(0, t["failed_text"])
    last = next((t["baseline_json"] for t in reversed(own) if t["baseline_json"]), None)
    return bool(own), last, failed


async def test_the_wire_expectation_reads_what_every_turn_would_say(store: StoreContract) -> None:
    """Random member histories (successes, settled failures whose query reached the model or
    not, not_settled turns, turns without a baseline, equal timestamps): the two short queries
    answer exactly what reading every turn answered, for the member and at a fork point."""
    import random
    from datetime import UTC, datetime, timedelta

    from state.wire_ledger import WireTurnRow

    rnd = random.Random(20261202)
    await store.ensure_member("u", "c", "m", "claude")
    base = datetime(2026, 12, 2, tzinfo=UTC)
    seen: list[tuple[bool, str | None, list[str]]] = []
    for i in range(60):
        outcome = rnd.choice(["succeeded", "succeeded", "failed", "failed", "not_settled"])
        conversational = rnd.random() < 0.8
        baseline = f'{{"turn": {i}}}' if rnd.random() < 0.85 else None
        failed_text = f"query {i}" if outcome == "failed" and conversational else None
        at = base + timedelta(seconds=i // 2)  # pairs of turns share a timestamp: job_id orders them
        job = f"j{i:03d}"
        await store.claim_job(job, "u", "c", "m", "d", "o")
        turn = WireTurnRow("u", "c", "m", job, i + 1, outcome, conversational, baseline, failed_text, at.isoformat())
        await store.finish_job("u", job, _receipt(job, "u", "c", str(i)), MemberOutcome("LIVE", outcome, wire=turn))
        got = await store.wire_expectation("u", "c", "m")
        want = _reference_expectation(rows(store, "wire_turns"), "m")
        assert (got.conversational, got.baseline_json, got.failed_texts) == want, i
        seen.append(want)
    # the histories covered every shape: none yet... runs of failed queries, no baseline at the end
    assert any(len(f) >= 2 for _, _, f in seen) and any(f == [] for _, _, f in seen)
    turns = sorted(rows(store, "wire_turns"), key=lambda t: (t["created_at"], t["job_id"]))
    for point in (0, 1, 17, 30, 60):
        at = [t for t in turns if t["conversational"] and t["settled_index"] <= point]
        assert await store.wire_baseline_at("u", "c", "m", point) == (at[-1]["baseline_json"] if at else None)
    empty = await store.wire_expectation("u", "c", "another")
    assert (empty.conversational, empty.baseline_json, empty.failed_texts) == (False, None, [])
    # the settle view: the job's records and the same expectation, in one round trip
    from state.wire_ledger import SettleQuery, WireRecordRow

    for n in range(3):
        await store.put_wire_record(WireRecordRow(f"r{n}", "u", "c", "m", "j059", f"000{n}", f'{{"n": {n}}}', None,
                                                  base.isoformat()))
    view = await store.wire_settle_view("u", "j059", SettleQuery("c", "m"))
    assert view.expectation == await store.wire_expectation("u", "c", "m")
    assert view.records == await store.wire_records_of_job("u", "c", "j059")
    assert [r.record_json for r in view.records] == ['{"n": 0}', '{"n": 1}', '{"n": 2}']


async def test_settle_job_decides_the_receipt_from_the_view_inside_the_commit(store: StoreContract) -> None:
    """``settle_job``: the job's records, the member's standing and (for a fork without a
    turn of its own) its source's baseline at the fork point go to ``decide``; what it returns
    is committed as ``finish_job`` commits it; a ``decide`` that raises commits nothing."""
    from datetime import UTC, datetime

    from state.wire_ledger import SettleQuery, WireRecordRow, WireTurnRow

    at = datetime(2026, 12, 3, tzinfo=UTC).isoformat()
    await store.ensure_member("u", "c", "src", "pi")
    for i, baseline in enumerate(['{"b": 1}', '{"b": 2}'], start=1):
        await store.claim_job(f"s{i}", "u", "c", "src", "d", "o")
        turn = WireTurnRow("u", "c", "src", f"s{i}", i, "succeeded", True, baseline, None, at)
        await store.finish_job("u", f"s{i}", _receipt(f"s{i}", "u", "c", "x"), MemberOutcome("LIVE", "succeeded",
                                                                                             wire=turn))
    await store.ensure_member("u", "c", "fork", "pi", forked_from="src")
    await store.claim_job("f1", "u", "c", "fork", "d", "o")
    await store.put_wire_record(WireRecordRow("r1", "u", "c", "fork", "f1", "0001", '{"n": 1}', None, at))
    seen = []
    receipt = _receipt("f1", "u", "c", "decided")

    def decider(job: str, index: int):
        def decide(view):
            seen.append(([r.record_id for r in view.records], view.expectation.conversational, view.fork_baseline))
            turn = WireTurnRow("u", "c", "fork", job, index, "succeeded", True, '{"b": 3}', None, at)
            return receipt, MemberOutcome("LIVE", "succeeded", verified("L-fork").verified, wire=turn)

        return decide

    decide = decider("f1", 1)

    def broken(view):
        raise ValueError("no verdict")

    with pytest.raises(ValueError, match="no verdict"):
        await store.settle_job("u", "f1", SettleQuery("c", "fork", ("src", 1)), broken)
    assert (await store.get_job("u", "f1")).state == JobState.RUNNING
    await store.settle_job("u", "f1", SettleQuery("c", "fork", ("src", 1)), decide)
    assert seen == [(["r1"], False, '{"b": 1}')]  # the source at turn 1, not its later turn 2
    done = await store.get_job("u", "f1")
    assert (done.state, done.receipt_json) == (JobState.DONE, receipt)
    fork = await store.get_member("u", "c", "fork")
    assert (fork.locator, fork.settled_turns) == (SavedLocator(id="L-fork"), 1)
    assert (await store.wire_expectation("u", "c", "fork")).baseline_json == '{"b": 3}'
    with pytest.raises(RuntimeError, match="already committed"):  # never commits twice
        await store.settle_job("u", "f1", SettleQuery("c", "fork", ("src", 1)), decide)
    # a member with a turn of its own reads no fork baseline; no member record: the records alone
    await store.claim_job("f2", "u", "c", "fork", "d", "o")
    await store.settle_job("u", "f2", SettleQuery("c", "fork", ("src", 1)), decider("f2", 2))
    await store.claim_job("n1", "u", "c", "ghost", "d", "o")
    await store.settle_job("u", "n1", SettleQuery("c", None), lambda view: (
        seen.append(([r.record_id for r in view.records], view.expectation.conversational, view.fork_baseline))
        or (_receipt("n1", "u", "c", "none"), None)))
    assert seen[1:] == [([], True, None), ([], False, None)]


async def test_the_proxy_services_handle_commits_without_its_own_flush_and_the_daemons_with(
        store: StoreContract, tmp_path) -> None:
    """The model proxy service's store (``sync_commits=False``): its wire records are committed
    (the daemon's handle reads them at once) without waiting for the disk; the daemon's commits
    wait for it, and with them everything the log holds before them (state/backends.py)."""
    from datetime import UTC, datetime

    from state.backends import open_store
    from state.wire_ledger import WireRecordRow

    url = getattr(store, "url", None)
    if url is not None:
        # the test cluster runs with synchronous_commit off (tests/support/postgres.py): this
        # database's sessions start with it on, as a production server's do
        import psycopg

        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute(f"ALTER DATABASE {conn.info.dbname} SET synchronous_commit = on")
        store = await second_handle(store, tmp_path)  # the daemon's handle, on a session begun since
    proxy = open_store(url, tmp_path / "s.db", sync_commits=False)
    await proxy.open()
    try:
        await proxy.put_wire_record(WireRecordRow("r-1", "u1", "c1", "m1", "j1", "0001", "{}", None,
                                                  datetime.now(UTC).isoformat()))
        assert [r.record_id for r in await store.wire_records_of_job("u1", "c1", "j1")] == ["r-1"]
        if isinstance(store, Store):
            assert isinstance(proxy, Store)
            # 2 = FULL: the WAL is flushed at every commit; 1 = NORMAL: only at checkpoints
            assert (store._db.execute("PRAGMA synchronous").fetchone()[0],
                    proxy._db.execute("PRAGMA synchronous").fetchone()[0]) == (2, 1)
        else:
            assert isinstance(store, PostgresStore) and isinstance(proxy, PostgresStore)
            settings = []
            for s in (store, proxy):
                async with s._pool.connection() as conn:
                    settings.append((await (await conn.execute("SHOW synchronous_commit")).fetchone())
                                    ["synchronous_commit"])
            assert settings == ["on", "off"]
    finally:
        await proxy.aclose()
        if url is not None:
            await store.aclose()


async def test_the_settle_view_reads_back_the_records_its_records_and_baselines_refer_to(
        store: StoreContract) -> None:
    """Records stored as differences (digest_parent) and baselines as references to their
    record (baseline_record): the view carries every record they lead back to, transitively,
    once each, up to the records the caller holds (``SettleQuery.known``), and only the chat's."""
    from datetime import UTC, datetime

    from state.wire_ledger import SettleQuery, WireRecordRow, WireTurnRow

    at = datetime(2026, 12, 7, tzinfo=UTC).isoformat()

    async def put(rid: str, job: str, parent: str | None, chat: str = "c") -> bool:
        return await store.put_wire_record(WireRecordRow(rid, "u", chat, "m", job, rid, f'{{"id": "{rid}"}}', None,
                                                         at, parent))

    await store.ensure_member("u", "c", "m", "pi")
    await put("r0", "j1", None)
    await put("r1", "j1", "r0")
    await put("r2", "j1", "r1")
    await put("x9", "jx", None, chat="other")  # another chat's record is never read
    await store.claim_job("j1", "u", "c", "m", "d", "o")
    turn = WireTurnRow("u", "c", "m", "j1", 1, "succeeded", True, '{"record_id": "r2"}', None, at, "r2")
    await store.finish_job("u", "j1", _receipt("j1", "u", "c", "one"), MemberOutcome("LIVE", "succeeded", wire=turn))
    await put("r3", "j2", "r2")
    await put("r4", "j2", "r3")  # its parent is the job's own record: not an ancestor
    # a difference whose parent the chat's ledger does not hold is not stored (the chat was
    # deleted and begun again while the proxy remembered its last record)
    assert await put("r5", "j2", "x9") is False and await put("r5", "j2", "nope") is False
    assert [r.record_id for r in await store.wire_records_of_job("u", "c", "j2")] == ["r3", "r4"]
    assert await put("r5", "j2", None) is True

    def ids(view) -> tuple[list[str], list[str], str | None]:
        return ([r.record_id for r in view.records], sorted(r.record_id for r in view.ancestors),
                view.expectation.baseline_record)

    cold = await store.wire_settle_view("u", "j2", SettleQuery("c", "m"))
    assert ids(cold) == (["r3", "r4", "r5"], ["r0", "r1", "r2"], "r2")
    assert [r.digest_parent for r in cold.records] == ["r2", "r3", None]
    assert {r.record_id: r.digest_parent for r in cold.ancestors} == {"r0": None, "r1": "r0", "r2": "r1"}
    hot = await store.wire_settle_view("u", "j2", SettleQuery("c", "m", known={"r2": ["whole"]}))
    assert ids(hot) == (["r3", "r4", "r5"], [], "r2")  # the usual turn: nothing read back
    halfway = await store.wire_settle_view("u", "j2", SettleQuery("c", "m", known={"r1": ["whole"]}))
    assert ids(halfway) == (["r3", "r4", "r5"], ["r2"], "r2")
    # a fork's first turn: its source's baseline at the fork point, and what that refers to
    await store.ensure_member("u", "c", "fork", "pi", forked_from="m")
    await store.claim_job("f1", "u", "c", "fork", "d", "o")
    fork = await store.wire_settle_view("u", "f1", SettleQuery("c", "fork", ("m", 1)))
    assert (fork.fork_baseline, fork.fork_baseline_record) == ('{"record_id": "r2"}', "r2")
    assert sorted(r.record_id for r in fork.ancestors) == ["r0", "r1", "r2"]


async def test_the_ancestors_of_records_are_read_in_one_call_nearest_first(store: StoreContract) -> None:
    """``wire_ancestors``: what seeds lead back to through digest_parent, seeds included, in
    their chat only, never past ``stop``, at most ``limit`` records (the nearest), each seed's
    chain in turn; a record the ledger lost ends its chain (the inspector's capture search)."""
    from datetime import UTC, datetime

    from state.wire_ledger import WireRecordRow
    from tests.support.store import lose_wire_record

    at = datetime(2026, 12, 7, tzinfo=UTC).isoformat()
    put: dict[str, WireRecordRow] = {}
    for rid, parent, chat in [("a0", None, "c"), ("a1", "a0", "c"), ("a2", "a1", "c"), ("b0", None, "c"),
                              ("b1", "b0", "c"), ("k1", "a1", "c"), ("o0", None, "other")]:
        put[rid] = WireRecordRow(rid, "u", chat, "m", "j", rid, f'{{"id": "{rid}"}}', f"capture {rid}", at, parent)
        assert await store.put_wire_record(put[rid])

    async def ids(seeds: list[str], chat: str = "c", **kw: object) -> list[str]:
        return [r.record_id for r in await store.wire_ancestors("u", chat, seeds, **kw)]  # type: ignore[arg-type]

    chain = await store.wire_ancestors("u", "c", ["a2"], limit=10)
    assert {r.record_id for r in chain} == {"a0", "a1", "a2"}
    assert sorted(chain, key=lambda r: r.record_id) == [put["a0"], put["a1"], put["a2"]]  # every column
    assert await ids(["a2"], limit=10) == ["a2", "a1", "a0"]  # nearest first
    assert await ids([], limit=10) == [] and await ids(["a2"], chat="other", limit=10) == []
    assert await ids(["a2"], stop={"a0"}, limit=10) == ["a2", "a1"]  # never past (nor at) a stop
    assert await ids(["a2", "b1"], stop=["a1", "b1"], limit=10) == ["a2"]
    assert await ids(["a2"], limit=2) == ["a2", "a1"]  # the limit keeps the nearest
    # each seed's chain in turn, the later ones up to where they join an earlier one
    assert await ids(["b1", "a2"], limit=10) == ["b1", "b0", "a2", "a1", "a0"]
    assert await ids(["k1", "a2", "k1"], limit=10) == ["k1", "a1", "a0", "a2"]
    assert await ids(["a2", "k1"], limit=4) == ["a2", "a1", "a0", "k1"]
    assert await ids(["k1", "a2"], limit=3) == ["k1", "a1", "a0"]
    # a record the chat's ledger does not hold (never stored, another chat's, lost) ends its chain
    assert await ids(["nope", "o0", "b1"], limit=10) == ["b1", "b0"]
    lose_wire_record(store, "a1")
    assert await ids(["a2", "k1"], limit=10) == ["a2", "k1"]
