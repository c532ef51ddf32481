"""The inspector's JSON routes and static page over a real store (SQLite in tmp) and a
fake engine: paging order and bounds, ownership, the host view, the /ui/ files."""

from __future__ import annotations

import sqlite3
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from runner.admission import Admission
from runner.daemon import Api, create_app
from runner.member_locks import MemberLocks
from runner.resident_memory import ResidentMemory
from runner.residents import ResidentPool
from runner.sandbox_room import SandboxRoom
from state.receipts import Receipt
from state.records import SandboxRecord, SandboxState
from state.store import Store

pytestmark = pytest.mark.anyio

TOKEN = "unit-test-inspector-token-9c1e"
AUTH = {"authorization": f"Bearer {TOKEN}"}
T0 = datetime(2025, 1, 2, 3, 4, 5, tzinfo=UTC)


def receipt(job_id: str, user: str = "u1", chat: str = "c1", status: str = "LIVE") -> str:
    return Receipt(job_id=job_id, user_id=user, chat_id=chat, member_id="m1", runtime="pi", context_status=status,
                   outcome="succeeded", locator_before="L1", locator_after="L1",
                   settlement={"evidence": "agent_end"}, started_at=T0, finished_at=T0).model_dump_json()


class FakeEngine:
    async def inspect(self, container_id: str) -> Any:
        raise AssertionError("native=false must not touch the engine")


@pytest.fixture
async def store(tmp_path):
    s = Store(tmp_path / "state.db")
    yield s
    s.close()


def supervisor(store: Store) -> Any:
    pool, locks = ResidentPool(), MemberLocks()
    room = SandboxRoom(None, busy=lambda chat: False)
    sup = SimpleNamespace(store=store, engine=FakeEngine(), pool=pool,
                          manager=SimpleNamespace(config=SimpleNamespace(host_id="host-a")),
                          memory=ResidentMemory(1024 * 1024 * 1024, pool=pool, locks=locks,
                                                registry=CollectorRegistry(), refresh_s=60),
                          capacity=SimpleNamespace(admission=Admission(max_turns=1, timeout_s=30, room=room)))
    sup.in_turn = lambda key: False
    return sup


async def attestation() -> dict[str, Any]:
    return {"source": {"sha": "abc123", "dirty": False}, "image": {"ref": "img:1", "id": "sha256:ff",
            "helper_version": "4"}, "required_helper": {"name": "http-agent-live-bridge", "version": 4},
            "engine": {"version": "27.0"}, "reverse_probe": {"ok": True, "age_s": 3.0},
            "heartbeat": {"age_s": 0.5, "stale": False}, "readiness": {"ready": True, "reasons": []}}


def client(store: Store) -> httpx.AsyncClient:
    api = Api(supervisor(store), SecretStr(TOKEN), max_message_bytes=1000, attestation=attestation)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=create_app(api)), base_url="http://daemon")


async def add_jobs(store: Store, user: str, chat: str, ids: list[str], created: dict[str, str] | None = None,
                   running: tuple[str, ...] = ()) -> None:
    for job_id in ids:
        await store.claim_job(job_id, user, chat, "m1", "digest-" + job_id, "owner")
        if job_id not in running:
            await store.finish_job(user, job_id, receipt(job_id, user, chat), None)
    if created:
        # Start times set by hand (a second connection to the same WAL database): ties and
        # out-of-name order, which the real clock rarely produces.
        db = sqlite3.connect(store.path)
        with db:
            for job_id, ts in created.items():
                db.execute("UPDATE jobs SET created_at=? WHERE user_id=? AND job_id=?", (ts, user, job_id))
        db.close()


async def test_turns_are_in_start_order_then_job_id_and_page_stably(store) -> None:
    same = "2025-01-02T03:04:05.000001+00:00"
    await add_jobs(store, "u1", "c1", ["j-c", "j-a", "j-b", "j-d", "j-e"],
                   created={"j-c": same, "j-a": same, "j-b": "2025-01-02T03:04:04+00:00",
                            "j-d": "2025-01-02T03:04:06+00:00", "j-e": "2025-01-02T03:04:07+00:00"},
                   running=("j-e",))
    async with client(store) as c:
        p1 = (await c.get("/v1/users/u1/chats/c1/turns", params={"limit": 2}, headers=AUTH)).json()
        assert [(t["index"], t["job_id"]) for t in p1["turns"]] == [(1, "j-b"), (2, "j-a")]
        assert p1["total"] == 5 and p1["next_cursor"]
        # a job started meanwhile lands at the end: the next page is unchanged
        await add_jobs(store, "u1", "c1", ["j-0"])
        p2 = (await c.get("/v1/users/u1/chats/c1/turns", params={"limit": 2, "cursor": p1["next_cursor"]},
                          headers=AUTH)).json()
        assert [(t["index"], t["job_id"]) for t in p2["turns"]] == [(3, "j-c"), (4, "j-d")]
        p3 = (await c.get("/v1/users/u1/chats/c1/turns", params={"limit": 2, "cursor": p2["next_cursor"]},
                          headers=AUTH)).json()
        assert [(t["index"], t["job_id"], t["state"]) for t in p3["turns"]] == [(5, "j-e", "running"),
                                                                                (6, "j-0", "done")]
        assert p3["next_cursor"] is None and p3["total"] == 6
        assert p3["turns"][0]["receipt"] is None
        assert p2["turns"][0]["receipt"]["job_id"] == "j-c"


@pytest.mark.parametrize(("params", "field", "message"), [
    ({"limit": "0"}, "limit", "must be between 1 and 200"),
    ({"limit": "201"}, "limit", "must be between 1 and 200"),
    ({"limit": "ten"}, "limit", "must be an integer"),
    ({"cursor": "not-a-cursor"}, "cursor", "not a cursor this API issued"),
    ({"cursor": "WyJ4IiwgInkiXQ"}, "cursor", "not a cursor this API issued"),  # ["x", "y"]
])
async def test_bad_paging_parameters_name_the_field(store, params, field, message) -> None:
    await add_jobs(store, "u1", "c1", ["j1"])
    async with client(store) as c:
        resp = await c.get("/v1/users/u1/chats/c1/turns", params=params, headers=AUTH)
    assert resp.status_code == 422
    assert [(e["field"], e["message"]) for e in resp.json()["detail"]] == [(field, message)]


async def test_another_users_chat_is_indistinguishable_from_a_missing_one(store) -> None:
    await add_jobs(store, "u1", "c1", ["j1"])
    async with client(store) as c:
        for path in ("turns", "inspect"):
            other = await c.get(f"/v1/users/u2/chats/c1/{path}", headers=AUTH)
            missing = await c.get(f"/v1/users/u2/chats/nope/{path}", headers=AUTH)
            assert (other.status_code, other.json()) == (missing.status_code, missing.json()) == \
                (404, {"error": "not_found"})
        bad = await c.get("/v1/users/u..1/chats/c1/turns", headers=AUTH)
        assert bad.status_code == 422 and bad.json()["detail"][0]["field"] == "user_id"


async def test_inspect_picks_the_turn_and_defaults_to_the_latest(store) -> None:
    await add_jobs(store, "u1", "c1", ["j1", "j2"], created={"j1": "2025-01-02T03:04:05+00:00",
                                                             "j2": "2025-01-02T03:04:06+00:00"})
    async with client(store) as c:
        latest = (await c.get("/v1/users/u1/chats/c1/inspect", headers=AUTH)).json()
        first = (await c.get("/v1/users/u1/chats/c1/inspect", params={"turn": 1}, headers=AUTH)).json()
        beyond = await c.get("/v1/users/u1/chats/c1/inspect", params={"turn": 3}, headers=AUTH)
        zero = await c.get("/v1/users/u1/chats/c1/inspect", params={"turn": 0}, headers=AUTH)
        native = await c.get("/v1/users/u1/chats/c1/inspect", params={"native": "maybe"}, headers=AUTH)
    assert (latest["turn"], latest["job_id"], first["turn"], first["job_id"]) == (2, "j2", 1, "j1")
    assert [s["name"] for s in latest["steps"]] == ["route", "identity", "native_state", "request"]
    assert latest["kind"] == "unverified"  # no wire verdict on this host yet: never guessed
    assert (beyond.status_code, beyond.json()) == (404, {"error": "not_found", "detail": "no turn 3: the chat has 2"})
    assert zero.status_code == 422 and zero.json()["detail"][0]["field"] == "turn"
    assert native.status_code == 422 and native.json()["detail"][0]["field"] == "native"


async def test_host_view_lists_sandboxes_the_budget_and_the_queue(store) -> None:
    for chat, state, used in (("c1", SandboxState.RUNNING, T0), ("c2", SandboxState.LOST, T0.replace(hour=9))):
        await store.put_sandbox(SandboxRecord(
            user_id="u1", chat_id=chat, container_id=f"id-{chat}", container_name=f"ca-{chat}", image_id="sha256:ff",
            data_root_id="dr", host_id="host-a", state=state,
            lost_reason="container_missing" if state == SandboxState.LOST else None, created_at=T0,
            last_used_at=used))
    async with client(store) as c:
        h = (await c.get("/v1/host", headers=AUTH)).json()
    assert h["host_id"] == "host-a" and h["residents"] == []
    assert (h["budget"], h["queue"]) == ({"limit_bytes": 1024 * 1024 * 1024, "used_bytes": 0},
                                         {"depth": 0, "entries": []})
    assert [(s["chat_id"], s["state"], s["lost_reason"]) for s in h["sandboxes"]] == [
        ("c2", "lost", "container_missing"), ("c1", "running", None)]
    assert h["sandboxes_total"] == 2
    a = h["attestation"]
    assert (a["source_sha"], a["required_helper"], a["helper_version"], a["ready"], a["probe_ok"]) == \
        ("abc123", "http-agent-live-bridge=4", "4", True, True)


@pytest.mark.parametrize("path", ["/v1/host", "/v1/users/u1/chats/c1/turns", "/v1/users/u1/chats/c1/inspect"])
async def test_the_data_needs_the_token(store, path) -> None:
    async with client(store) as c:
        resp = await c.get(path, headers={"authorization": "Bearer wrong"})
    assert (resp.status_code, resp.json()) == (401, {"error": "unauthorized"})


async def test_the_page_is_static_files_without_a_token(store) -> None:
    async with client(store) as c:
        root = await c.get("/ui")
        index = await c.get("/ui/")
        js = await c.get("/ui/app.js")
        css = await c.get("/ui/style.css")
        escape = await c.get("/ui/%2e%2e/daemon.py")
        other = await c.get("/ui/../receipts.py")
        missing = await c.get("/ui/nope.js")
    assert (root.status_code, root.headers["location"]) == (307, "/ui/")
    assert index.status_code == 200 and index.headers["content-type"] == "text/html; charset=utf-8"
    assert '<script type="module" src="app.js"></script>' in index.text
    assert js.headers["content-type"] == "text/javascript; charset=utf-8"
    assert css.headers["content-type"] == "text/css; charset=utf-8"
    csp = index.headers["content-security-policy"]
    assert "default-src 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp
    assert [r.status_code for r in (escape, other, missing)] == [404, 404, 404]


def test_the_page_loads_nothing_from_elsewhere() -> None:
    from runner.inspector_api import UI_DIR

    texts = {p.name: p.read_text() for p in UI_DIR.iterdir()}
    assert set(texts) == {"index.html", "style.css", "app.js", "api.js", "dom.js", "timeline.js", "chat.js",
                          "host.js", "favicon.svg"}
    for name, text in texts.items():
        for marker in ("http://", "https://", "//cdn", "@import", "url("):
            assert marker not in text.replace('xmlns="http://www.w3.org/2000/svg"', ""), (name, marker)
        assert "innerHTML" not in text, name  # data goes in as text only
