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
from proxy.routes import member_base_url
from runner.config import load_settings
from runner.model_path import ModelPath
from runner.proxy_attribution import Attribution, LedgerSink
from sandbox_manager.identity import container_name, member_key
from sandbox_manager.sealing import MODEL_PORT
from state.jobs import Job
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
    _sinks.clear()
    yield mp
    _sinks.clear()
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
    await sink_of(mp).put(rec, member)


class _Sink:
    """The proxy's sink for chat C (its socket open): one per store, so a member's records
    chain as the proxy service stores them (``fresh`` forgets them: a restarted proxy)."""

    def __init__(self, store: Store) -> None:
        self.attribution = Attribution()
        self.attribution.open_chat(container_name(U, C), U, C)
        self.sink = LedgerSink(store, self.attribution)

    async def put(self, rec: WireRecord, member: str) -> None:
        self.attribution.member(container_name(U, C), member_key(member), member)
        await self.sink.put(rec)


_sinks: dict[int, _Sink] = {}


def sink_of(mp: ModelPath, *, fresh: bool = False) -> _Sink:
    if fresh or id(mp.store) not in _sinks:
        _sinks[id(mp.store)] = _Sink(mp.store)  # type: ignore[arg-type]
    return _sinks[id(mp.store)]


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
    # a record stored as a difference captured the texts after the ones it shares with its parent
    # (whose capture holds those): the summary and the rewritten history share nothing, whole
    captured = [[(m["role"], m["text"]) for m in json.loads(r["capture_json"])["request"]] for r in records]
    assert captured == [[("user", "a")], [("assistant", "ra"), ("user", "b")], [("user", "c")],
                        [("assistant", "rc"), ("user", "d")], [("user", "summarise")],
                        [("user", "summary text"), ("user", "d")]]
    assert [json.loads(r["record_json"]).get("digest_shared") for r in records] == [None, 1, 3, 4, None, None]


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


async def test_a_member_whose_turn_began_is_not_told_again_as_its_cli_launches(path: ModelPath) -> None:
    """The turn's begin names the member, on the same connection and before anything of the
    turn: the launch's gateway asks nothing more of the proxy. A member with no turn begun (a
    fork's new member) and one whose turn was flushed are told as before."""
    calls: list[tuple[str, ...]] = []

    class Ops:
        async def begin(self, key: str, mk: str, member_id: str, job_id: str) -> None:
            calls.append(("begin", member_id, job_id))

        async def member(self, key: str, mk: str, member_id: str) -> None:
            calls.append(("member", member_id))

        async def flush(self, key: str, timeout_s: float, end_of: Any = None) -> None:
            calls.append(("flush", *(end_of or ())))

    path._ops = Ops()  # type: ignore[assignment]
    job = Job(job_id="j1", user_id=U, chat_id=C, member_id="m1", runtime="codex", message="hi")
    await path.begin(job)
    gateway = await path.gateway(U, C, "m1", "fixture-model")
    assert (gateway.base_url, gateway.model) == (member_base_url(MODEL_PORT, member_key("m1")), "fixture-model")
    await path.gateway(U, C, "m2", "fixture-model")  # no turn of m2 begun
    assert calls == [("begin", "m1", "j1"), ("member", "m2")]
    now = datetime.now(UTC)
    await path.flush(Receipt(job_id="j1", user_id=U, chat_id=C, member_id="m1", runtime="codex",
                             context_status=None, outcome=Outcome.SUCCEEDED, started_at=now, finished_at=now))
    await path.gateway(U, C, "m1", "fixture-model")  # its turn is over: told again
    assert calls[2:] == [("flush", member_key("m1"), "j1"), ("member", "m1")]


def conversation(turns: int, message: str | None = None) -> list[tuple[str, str]]:
    """A member's request after ``turns`` turns: each turn's message and reply, then ``message``."""
    conv = [m for i in range(turns) for m in (("user", f"q{i}"), ("assistant", f"r{i}"))]
    return [*conv, ("user", message or f"q{turns}")]


async def turns(mp: ModelPath, member: str, n: int, start: int = 0) -> list[dict[str, Any]]:
    wires = []
    for i in range(start, start + n):
        await request(mp, member, f"{member}-j{i}", conversation(i), f"r{i}")
        wires.append(await settle(mp, member, f"{member}-j{i}", f"q{i}", Outcome.SUCCEEDED))
    return wires


async def test_each_request_is_stored_as_its_difference_from_the_previous_one(path: ModelPath) -> None:
    """The ledger grew with the square of a chat's turns (issue 16): each record held its
    request's whole digest and each turn's baseline the whole conversation again. Now a record
    holds what its request added to the member's previous one, a baseline its record's id."""
    wires = await turns(path, "m1", 12)
    assert [w["history"] for w in wires] == ["new", *["complete"] * 11]
    records = rows(path.store, "wire_records")
    docs = [json.loads(r["record_json"]) for r in records]
    assert [len(doc["digest"]) for doc in docs] == [1, *[2] * 11]  # the previous reply and this message
    assert [doc["digest_shared"] for doc in docs] == [None, *range(1, 22, 2)]
    assert [r["digest_parent"] for r in records] == [None, *(r["record_id"] for r in records[:-1])]
    assert [doc["digest_parent"] for doc in docs] == [r["digest_parent"] for r in records]
    assert docs[5]["digest"] == [d("assistant", "r4"), d("user", "q5")]
    baselines = rows(path.store, "wire_turns")
    assert [t["baseline_record"] for t in baselines] == [r["record_id"] for r in records]
    assert json.loads(baselines[-1]["baseline_json"]) == {"record_id": records[-1]["record_id"],
                                                          "reply": [d("assistant", "r11")]}
    # what a record and a baseline take no longer grows with the history (a few digits of
    # digest_shared and seq apart)
    sizes = [len(r["record_json"]) for r in records[1:]]
    assert max(sizes) - min(sizes) <= 4 and len({len(t["baseline_json"]) for t in baselines}) == 1


async def test_a_restarted_daemon_reads_the_chain_back_and_judges_alike(path: ModelPath) -> None:
    """The daemon that committed a member's last turn holds its record's whole digest, so the
    next view reads no earlier record; a restarted one (nothing kept) reads the chain back to
    the whole record it starts from, and judges the same: complete, and a gap where one is."""
    await turns(path, "m1", 6)
    member = await path.store.get_member(U, C, "m1")
    receipt = Receipt(job_id="m1-j6", user_id=U, chat_id=C, member_id="m1", runtime="codex", context_status=None,
                      outcome=Outcome.SUCCEEDED, started_at=datetime.now(UTC), finished_at=datetime.now(UTC))
    await request(path, "m1", "m1-j6", conversation(6), "r6")
    hot = await path.store.wire_settle_view(U, "m1-j6", path.settle_query(receipt, member))
    assert hot.ancestors == []
    path.baselines = type(path.baselines)()  # a restart: nothing kept
    cold = await path.store.wire_settle_view(U, "m1-j6", path.settle_query(receipt, member))
    assert sorted(r.record_id for r in cold.ancestors) == sorted(r["record_id"] for r in rows(path.store,
                                                                                              "wire_records")[:6])
    assert (await settle(path, "m1", "m1-j6", "q6", Outcome.SUCCEEDED))["history"] == "complete"
    path.baselines = type(path.baselines)()
    dropped = [m for m in conversation(7) if m != ("user", "q3")]  # the CLI lost a message of turn 3
    await request(path, "m1", "m1-j7", dropped, "r7")
    wire = await settle(path, "m1", "m1-j7", "q7", Outcome.SUCCEEDED)
    assert (wire["history"], wire["first_difference"]) == ("gap", {
        "index": 6, "role": "user", "expected_digest": d("user", "q3")["sha256"],
        "observed_digest": d("assistant", "r3")["sha256"]})
    assert json.loads(rows(path.store, "wire_records")[-1]["record_json"])["digest_shared"] == 6  # a, ra .. r2


async def test_a_chain_is_stored_whole_every_keyframe_depth_records(path: ModelPath) -> None:
    """Rebuilding a digest never reads more than KEYFRAME_DEPTH records back."""
    from proxy.stored_digest import KEYFRAME_DEPTH

    for i in range(2 * KEYFRAME_DEPTH + 2):
        await request(path, "m1", "j1", conversation(i), f"r{i}")
    whole = [i for i, r in enumerate(rows(path.store, "wire_records")) if r["digest_parent"] is None]
    assert whole == [0, KEYFRAME_DEPTH, 2 * KEYFRAME_DEPTH]
    docs = [json.loads(r["record_json"]) for r in rows(path.store, "wire_records")]
    assert len(docs[KEYFRAME_DEPTH]["digest"]) == 2 * KEYFRAME_DEPTH + 1 and docs[KEYFRAME_DEPTH]["digest_shared"] is None


async def test_only_a_stored_record_is_a_parent_and_a_restarted_proxy_starts_whole(path: ModelPath) -> None:
    """A record whose write failed is never a parent (the proxy drops it); a proxy service that
    restarted knows no previous record and stores the next one whole; each is judged alike."""
    await turns(path, "m1", 2)
    put = path.store.put_wire_record

    async def failing(row: Any) -> None:
        raise RuntimeError("the store is away")

    path.store.put_wire_record = failing  # type: ignore[method-assign]
    with pytest.raises(RuntimeError):
        await request(path, "m1", "lost", conversation(2, "lost"), "r-lost")
    path.store.put_wire_record = put  # type: ignore[method-assign]
    wires = await turns(path, "m1", 1, start=2)
    before = rows(path.store, "wire_records")
    assert json.loads(before[-1]["record_json"])["digest_shared"] == 3 and before[-1]["digest_parent"] == before[-2][
        "record_id"]
    sink_of(path, fresh=True)  # the proxy service restarted
    wires += await turns(path, "m1", 1, start=3)
    last = rows(path.store, "wire_records")[-1]
    assert last["digest_parent"] is None and len(json.loads(last["record_json"])["digest"]) == 7
    assert [w["history"] for w in wires] == ["complete", "complete"]


async def test_a_deleted_chat_s_records_are_no_parent_of_the_new_chat_s(path: ModelPath) -> None:
    """The chat is deleted (its ledger with it) while the proxy still remembers its members'
    last records (its socket's close not yet told): the new chat's first record is stored whole."""
    await turns(path, "m1", 2)
    await path.store.delete_wire_chat(U, C)
    path.baselines.forget_chat(U, C)
    await path.store.delete_chat(U, C)
    wire = (await turns(path, "m1", 1, start=2))[0]
    (row,) = rows(path.store, "wire_records")
    assert row["digest_parent"] is None and len(json.loads(row["record_json"])["digest"]) == 5
    assert wire["history"] == "new"


async def test_a_baseline_whose_record_is_gone_is_a_gap_never_complete(path: ModelPath) -> None:
    """Only a damaged store lacks a baseline's record: the verdict cannot say what the model was
    shown, so it is a gap at the first entry (and logged), not a history nobody checked."""
    from structlog.testing import capture_logs

    await turns(path, "m1", 3)
    gone = rows(path.store, "wire_turns")[-1]["baseline_record"]
    path.store._db.execute("DELETE FROM wire_records WHERE record_id=?", (gone,))  # noqa: SLF001 - damage the store
    path.baselines = type(path.baselines)()  # a restart: nothing kept
    sink_of(path, fresh=True)
    await request(path, "m1", "m1-side", [("user", "title?")], "a title", kind="title")
    with capture_logs() as logs:
        side = await settle(path, "m1", "m1-side", "q-side", Outcome.SUCCEEDED)
        # the daemon never claims to hold the gone record's digest (a later view would not read it)
        assert side["history"] == "none" and path.baselines.whole_digests((U, C, "m1")) == {}
        await request(path, "m1", "m1-j3", conversation(3), "r3")
        wire = await settle(path, "m1", "m1-j3", "q3", Outcome.SUCCEEDED)
    assert (wire["history"], wire["first_difference"]) == ("gap", {
        "index": 0, "role": "user", "expected_digest": "0" * 64, "observed_digest": d("user", "q0")["sha256"]})
    assert [e for e in logs if e["event"] == "wire.baseline_unreadable"] == [
        {"event": "wire.baseline_unreadable", "record_id": gone, "log_level": "error"}] * 2


async def test_a_ledger_written_before_differences_is_judged_as_before(path: ModelPath) -> None:
    """Rows written before migration 11: records and a baseline stored whole (no record id)."""
    from proxy import Baseline
    from state.wire_ledger import WireRecordRow, WireTurnRow

    await path.store.ensure_member(U, C, "m1", "codex")
    await path.store.claim_job("old", U, C, "m1", "digest", "owner")
    old = WireRecord(seq=1, chat_key=container_name(U, C), member_key=member_key("m1"), job_id="old",
                     started_at=datetime.now(UTC), duration_ms=1.0, method="POST", path="/v1/responses",
                     route="openai.responses", api="responses", kind="conversation", side=False, status=200,
                     bytes_in=1, bytes_out=1, digest=[DigestEntry.text("user", "q0")],
                     reply=[DigestEntry.text("assistant", "r0")])
    now = datetime.now(UTC).isoformat()
    await path.store.put_wire_record(WireRecordRow("r-old", U, C, "m1", "old", "0", old.model_dump_json(
        exclude={"digest_parent", "digest_shared"}), None, now))
    baseline = Baseline(conversation=old.digest or [], reply=old.reply or []).model_dump_json()
    turn = WireTurnRow(U, C, "m1", "old", 1, "succeeded", True, baseline, None, now)
    receipt = Receipt(job_id="old", user_id=U, chat_id=C, member_id="m1", runtime="codex", context_status=None,
                      outcome=Outcome.SUCCEEDED, started_at=datetime.now(UTC), finished_at=datetime.now(UTC))
    await path.store.finish_job(U, "old", receipt.model_dump_json(), MemberOutcome(
        "LIVE", "succeeded", verified=VerifiedTurn(SavedLocator(id="loc-1")), wire=turn))
    assert (await turns(path, "m1", 1, start=1))[0]["history"] == "complete"
    await request(path, "m1", "m1-j2", conversation(2, "q2"), "r2")
    path.baselines = type(path.baselines)()
    assert (await settle(path, "m1", "m1-j2", "q2", Outcome.SUCCEEDED))["history"] == "complete"
