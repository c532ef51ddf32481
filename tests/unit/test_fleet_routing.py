"""Fleet membership and routing over one shared store (SQLite here; the PostgreSQL side of
the same store calls is in test_store_contract.py, the real multi-host suite in tests/fleet)."""

from __future__ import annotations

import anyio
import pytest

from runner.fleet import Fleet
from state.jobs import Job
from state.records import SandboxState
from state.store import Store

pytestmark = pytest.mark.anyio


def job(n: int, chat: str = "c1") -> Job:
    return Job(job_id=f"j{n}", user_id="u", chat_id=chat, member_id="m", runtime="codex", message=f"hello {n}")


async def two_hosts(tmp_path, ttl1: float = 30.0, paused=None) -> tuple[Fleet, Fleet]:
    a = Fleet(Store(tmp_path / "s.db"), host_id="h1", api_url="http://127.0.0.1:1", capacity=10, ttl_s=ttl1,
              lease_paused=paused)
    b = Fleet(Store(tmp_path / "s.db"), host_id="h2", api_url="http://127.0.0.1:2", capacity=10, ttl_s=30)
    await a.join()
    await b.join()
    return a, b


async def test_the_owner_serves_locally_every_other_host_forwards(tmp_path) -> None:
    a, b = await two_hosts(tmp_path)
    assert (await b.route("u", "c1", place=True)).kind == "forward"  # placed on h1 (ties: by host id)
    route = await a.route("u", "c1", place=True)
    assert (route.kind, route.placement.host_id, route.placement.api_url) == ("local", "h1", "http://127.0.0.1:1")
    assert (await b.route("u", "c2", place=True)).kind == "local"  # h2 now has the most free capacity
    assert (await a.route("u", "never-seen", place=False)).kind == "local"  # GETs place nothing


async def test_an_expired_host_is_fenced_and_its_chats_are_lost_everywhere(tmp_path) -> None:
    a, b = await two_hosts(tmp_path)
    assert (await a.route("u", "c1", place=True)).kind == "local"
    await a.store.ensure_member("u", "c1", "m", "codex")
    claim = await a.store.claim_job("j1", "u", "c1", "m", job(1).digest(), "owner-a")
    assert claim.kind == "claimed"
    await a.store.renew_lease(a.lease, 0.0)  # no heartbeat: the lease runs out (by the store's clock)
    await anyio.sleep(0.1)
    assert (await a.route("u", "c1", place=True)).kind == "fenced"  # it accepts no work
    assert a.fenced and not a.lease_valid()
    assert (await b.route("u", "c1", place=True)).kind == "lost"
    assert (await b.route("u", "c9", place=True)).placement.host_id == "h2"  # never placed on h1
    closed = await b.close_orphan(await b.store.get_job("u", "j1"))
    assert (closed.outcome, closed.reason, closed.context_status) == ("not_settled", "host_lost", None)
    answer = await b.answer_lost(job(2), "owner-b")
    r = answer.receipt
    assert (answer.kind, answer.fresh, r.context_status, r.outcome, r.reason) == \
        ("done", True, "LOST", "refused", "host_lost")
    again = await b.answer_lost(job(2), "owner-b")
    assert (again.kind, again.fresh, again.receipt) == ("done", False, r)  # the job fence holds
    assert (await b.answer_lost(job(2).model_copy(update={"message": "other"}), "owner-b")).kind == "conflict"
    assert (await b.store.get_member("u", "c1", "m")).lost_reason == "host_lost"


async def test_condemn_marks_the_sandbox_record_lost(tmp_path) -> None:
    from datetime import UTC, datetime

    from state.records import SandboxRecord

    a, b = await two_hosts(tmp_path)
    ts = datetime.now(UTC)
    await a.store.put_sandbox(SandboxRecord(user_id="u", chat_id="c1", container_id="x", container_name="n",
                                            image_id="i", data_root_id="d", host_id="h1",
                                            state=SandboxState.RUNNING, created_at=ts, last_used_at=ts))
    await b.condemn("u", "c1")
    rec = await b.store.get_sandbox("u", "c1")
    assert (rec.state, rec.lost_reason) == (SandboxState.LOST, "host_lost")


async def test_a_paused_heartbeat_lets_the_lease_run_out(tmp_path) -> None:
    paused = {"on": False}
    a, b = await two_hosts(tmp_path, ttl1=1.5, paused=lambda: paused["on"])
    async with anyio.create_task_group() as tg:
        tg.start_soon(a._lease_loop)
        await anyio.sleep(2.0)  # renewed every 0.5 s: still live
        assert a.lease_valid() and [h.live for h in await b.store.list_hosts()] == [True, True]
        paused["on"] = True
        await anyio.sleep(2.5)
        assert not a.lease_valid()
        assert [h.live for h in await b.store.list_hosts()] == [False, True]
        paused["on"] = False
        await anyio.sleep(1.0)  # the next renewal is refused: fenced for good
        assert a.fenced
        tg.cancel_scope.cancel()


async def test_a_lost_hosts_chat_is_deleted_here_and_a_live_owners_is_forwarded(tmp_path) -> None:
    from starlette.requests import Request

    from runner.forwarding import FleetGate

    def request(method: str) -> Request:
        return Request({"type": "http", "method": method, "path": "/v1/users/u/chats/c1", "query_string": b"",
                        "headers": []})

    a, b = await two_hosts(tmp_path)
    assert (await a.route("u", "c1", place=True)).kind == "local"
    gate = FleetGate(b, None, owner="owner-b", timeout_s=1.0)
    try:
        # a live owner: b forwards the deletion to a (which is not listening here: 503, nothing done)
        forwarded = await gate.chat(request("DELETE"), "u", "c1", b"")
        assert (forwarded.status_code, forwarded.body) == (503, b'{"error":"host_unreachable","detail":'
                                                                 b'"the chat\'s host does not answer (it is lost'
                                                                 b' once its lease expires)"}')
        await a.store.renew_lease(a.lease, 0.0)  # a's lease runs out: its chats are lost
        assert await gate.chat(request("DELETE"), "u", "c1", b"") is None  # deleted by b, from the store
        refused = await gate.chat(request("POST"), "u", "c1", b"")
        assert refused.status_code == 409 and b"host_lost" in refused.body
    finally:
        await gate.aclose()
