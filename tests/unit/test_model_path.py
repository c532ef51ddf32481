"""The wire ledger (runner/proxy_attribution.py) and the daemon's verdicts (runner/model_path.py)
on a real SQLite store: what a turn leaves for the next, failed queries kept until a success, a
fork compared with its source at the fork point, a summary request as compaction evidence, texts
only with capture on."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from proxy import DigestEntry, ProxyConfig, WireRecord
from runner.config import load_settings
from runner.model_path import ModelPath
from runner.proxy_attribution import Attribution, LedgerSink
from sandbox_manager.identity import container_name, member_key
from state.receipts import Outcome, Receipt
from state.records import SavedLocator
from state.store import MemberOutcome, Store, VerifiedTurn
from tests.support.store import rows

pytestmark = pytest.mark.anyio
U, C = "u1", "c1"


@pytest.fixture
async def path(tmp_path):
    store = Store(tmp_path / "store.db")
    key = tmp_path / "key"
    key.write_text("sk-unit-test-key\n")
    settings = load_settings({"CLOUD_AGENT_HOME": str(tmp_path)})
    mp = ModelPath(settings, "http://127.0.0.1:9", store, None,  # type: ignore[arg-type]
                   config=ProxyConfig(upstream_url="http://127.0.0.1:9", key_file=key, capture=True))
    yield mp
    store.close()


def d(role: str, text: str) -> dict[str, str]:
    return dataclasses.asdict(DigestEntry.text(role, text))  # type: ignore[arg-type]


seq = iter(range(1, 10_000))


async def request(mp: ModelPath, member: str, job: str, conv: list[tuple[str, str]], reply: str | None,
                  kind: str = "conversation") -> None:
    rec = WireRecord(seq=next(seq), chat_key=container_name(U, C), member_key=member_key(member), job_id=job,
                     started_at=datetime.now(UTC), duration_ms=1.0, method="POST", path="/v1/responses",
                     route="openai.responses", api="responses", kind=kind, side=kind != "conversation", status=200,
                     bytes_in=1, bytes_out=1, digest=[DigestEntry.text(r, t) for r, t in conv],  # type: ignore[arg-type]
                     reply=[DigestEntry.text("assistant", reply)] if reply else None,
                     capture=[{"role": r, "text": t} for r, t in conv], reply_capture=None)  # type: ignore[misc]
    attribution = Attribution()  # the proxy's: the socket of chat C is open, member's CLI sent it
    attribution.open_chat(container_name(U, C), U, C)
    attribution.member(container_name(U, C), member_key(member), member)
    await LedgerSink(mp.store, attribution).put(rec)


async def settle(mp: ModelPath, member: str, job: str, message: str, outcome: Outcome) -> dict[str, Any]:
    m = await mp.store.ensure_member(U, C, member, "codex")
    now = datetime.now(UTC)
    await mp.store.claim_job(job, U, C, member, "digest", "owner")
    receipt = Receipt(job_id=job, user_id=U, chat_id=C, member_id=member, runtime="codex", context_status=None,
                      outcome=outcome, started_at=now, finished_at=now)
    wire, row = await mp.settle(receipt, await mp.store.get_member(U, C, member), message=message, compaction=False,
                                settled_index=m.settled_turns + 1)
    verified = VerifiedTurn(SavedLocator(id="loc-1"))  # a settled turn: the member's settled_turns + 1
    await mp.store.finish_job(U, job, receipt.model_dump_json(),
                              MemberOutcome("LIVE", outcome.value, verified=verified, wire=row))
    return wire.model_dump()


async def test_turns_failures_and_a_summary(path: ModelPath) -> None:
    await request(path, "m1", "j1", [("user", "a")], "ra")
    assert (await settle(path, "m1", "j1", "a", Outcome.SUCCEEDED))["history"] == "new"
    await request(path, "m1", "j2", [("user", "a"), ("assistant", "ra"), ("user", "b")], None)
    assert (await settle(path, "m1", "j2", "b", Outcome.FAILED))["history"] == "complete"
    # the failed query's text is kept for the next verdict, and cleared by the next success
    assert [r["failed_text"] for r in rows(path.store, "wire_turns")] == [None, "b"]
    await request(path, "m1", "j3", [("user", "a"), ("assistant", "ra"), ("user", "b"), ("user", "c")], "rc")
    assert (await settle(path, "m1", "j3", "c", Outcome.SUCCEEDED))["history"] == "complete"
    assert [r["failed_text"] for r in rows(path.store, "wire_turns")] == [None, None, None]
    # a turn whose CLI summarised (a summary request) and rewrote its history: compacted
    await request(path, "m1", "j4", [("user", "a"), ("assistant", "ra"), ("user", "b"), ("user", "c"),
                                     ("assistant", "rc"), ("user", "d")], None)
    await request(path, "m1", "j4", [("user", "summarise")], "summary", kind="summary")
    await request(path, "m1", "j4", [("user", "summary text"), ("user", "d")], "rd")
    wire = await settle(path, "m1", "j4", "d", Outcome.SUCCEEDED)
    assert (wire["history"], wire["requests"], wire["side_requests"]) == ("compacted", 3, 1)
    assert wire["first_difference"] == {"index": 0, "role": "user", "expected_digest": d("user", "a")["sha256"],
                                        "observed_digest": d("user", "summary text")["sha256"]}
    # digests in the record, texts only in capture_json
    records = rows(path.store, "wire_records")
    assert all("capture" not in json.loads(r["record_json"]) for r in records)
    assert json.loads(records[0]["capture_json"]) == {"request": [{"role": "user", "text": "a"}], "reply": []}


async def test_a_verdict_never_compares_with_a_baseline_that_was_not_committed(path: ModelPath) -> None:
    """The daemon keeps each member's last baseline parsed (runner.baseline_cache). A turn
    judged but never committed (its commit rolled back) leaves one kept that the store does not
    hold: the next turn compares with the store's, the last committed turn's."""
    await request(path, "m1", "j1", [("user", "a")], "ra")
    assert (await settle(path, "m1", "j1", "a", Outcome.SUCCEEDED))["history"] == "new"
    await request(path, "m1", "j2", [("user", "a"), ("assistant", "ra"), ("user", "b")], "rb")
    now = datetime.now(UTC)
    await path.store.claim_job("j2", U, C, "m1", "digest", "owner")
    judged = Receipt(job_id="j2", user_id=U, chat_id=C, member_id="m1", runtime="codex", context_status=None,
                     outcome=Outcome.SUCCEEDED, started_at=now, finished_at=now)
    wire, _ = await path.settle(judged, await path.store.get_member(U, C, "m1"), message="b", compaction=False,
                                settled_index=2)
    assert wire.history == "complete"  # judged, and never committed
    await request(path, "m1", "j3", [("user", "a"), ("assistant", "ra"), ("user", "c")], "rc")
    wire3 = await settle(path, "m1", "j3", "c", Outcome.SUCCEEDED)
    assert (wire3["history"], wire3["first_difference"]) == ("complete", None)
    await request(path, "m1", "j4", [("user", "a"), ("assistant", "ra"), ("user", "d")], "rd")
    wire4 = await settle(path, "m1", "j4", "d", Outcome.SUCCEEDED)  # j3's turn is dropped from the history
    assert (wire4["history"], wire4["first_difference"]) == ("gap", {
        "index": 2, "role": "user", "expected_digest": d("user", "c")["sha256"],
        "observed_digest": d("user", "d")["sha256"]})


async def test_a_fork_compares_with_its_source_at_the_fork_point(path: ModelPath) -> None:
    await request(path, "src", "s1", [("user", "a")], "ra")
    await settle(path, "src", "s1", "a", Outcome.SUCCEEDED)
    await request(path, "src", "s2", [("user", "a"), ("assistant", "ra"), ("user", "b")], "rb")
    await settle(path, "src", "s2", "b", Outcome.SUCCEEDED)
    source = await path.store.get_member(U, C, "src")
    await path.store.create_fork_member(source, "fork", home_member_id="src", locator=None, settled_turns=1,
                                        pending=None)
    # forked at turn 1: the expected prefix is a, ra — not the source's later b, rb
    await request(path, "fork", "f1", [("user", "a"), ("assistant", "ra"), ("user", "x")], "rx")
    wire = await settle(path, "fork", "f1", "x", Outcome.SUCCEEDED)
    assert (wire["history"], wire["first_difference"]) == ("complete", None)


async def test_captured_texts_are_purged_after_the_retention(path: ModelPath) -> None:
    await request(path, "m1", "j1", [("user", "a")], "ra")
    assert await path.purge_capture() == 0  # younger than CLOUD_AGENT_WIRE_CAPTURE_DAYS
    old = (datetime.now(UTC) - timedelta(days=8)).isoformat()
    path.store._db.execute("UPDATE wire_records SET created_at=?", (old,))  # noqa: SLF001 - age the row
    assert await path.purge_capture() == 1
    (row,) = rows(path.store, "wire_records")
    assert row["capture_json"] is None and json.loads(row["record_json"])["digest"] == [d("user", "a")]


async def test_a_turns_open_asks_the_proxy_once_per_connection(path: ModelPath, tmp_path) -> None:
    """Every turn opens its chat's socket; once the current connection to the proxy has opened
    it the answer is known, and a new connection (a reconnect: it replays every open) asks again."""
    from types import SimpleNamespace

    calls: list[str] = []

    class Ops:
        async def open(self, key: str, user_id: str, chat_id: str, directory: Any) -> Any:
            calls.append(key)
            return tmp_path / key / "model.sock"

        async def close(self, key: str) -> None:
            calls.append(f"close {key}")

    path.manager = SimpleNamespace(socket_dir=lambda u, c: tmp_path / c)  # type: ignore[assignment]
    first = Ops()
    path._ops = first  # type: ignore[assignment]
    p1 = await path.open(U, C)
    assert await path.open(U, C) == p1 and await path.open(U, C) == p1
    assert calls == [container_name(U, C)]
    path._ops = Ops()  # type: ignore[assignment]  # another connection
    assert await path.open(U, C) == p1
    assert calls == [container_name(U, C)] * 2
    await path.close(U, C)  # closed: the next turn's open asks again
    await path.open(U, C)
    assert calls == [container_name(U, C)] * 2 + [f"close {container_name(U, C)}", container_name(U, C)]
