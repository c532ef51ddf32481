"""A record's digest stored as its difference from an earlier record (proxy/stored_digest.py):
what is shared, what is stored, and the whole digests a reader gets back."""

from __future__ import annotations

from datetime import UTC, datetime

from proxy import DigestEntry, WireRecord
from proxy.stored_digest import BaselineRef, as_difference, rebuild, shared_prefix


def entries(*texts: str) -> list[DigestEntry]:
    return [DigestEntry.text("assistant" if t.startswith("r") else "user", t) for t in texts]


def record(*texts: str) -> WireRecord:
    return WireRecord(seq=1, chat_key="k", member_key="mk", job_id="j", started_at=datetime.now(UTC), duration_ms=1.0,
                      method="POST", path="/v1/messages", route="anthropic.messages", api="anthropic",
                      kind="conversation", side=False, status=200, bytes_in=1, bytes_out=1, digest=entries(*texts),
                      reply=entries("reply"))


def test_the_shared_prefix_is_where_the_two_first_differ() -> None:
    assert shared_prefix(entries("a", "ra", "b"), entries("a", "ra", "b", "rb", "c")) == 3  # an extension
    assert shared_prefix(entries("a", "ra", "b"), entries("a", "ra", "x", "rx")) == 2  # rewritten after ra
    assert shared_prefix(entries("a", "ra", "b"), entries("a", "ra")) == 2  # shorter
    assert shared_prefix(entries("a"), entries("summary", "a")) == 0
    assert shared_prefix([], entries("a")) == 0
    # the same text under another role is another entry
    assert shared_prefix([DigestEntry.text("user", "a")], [DigestEntry.text("assistant", "a")]) == 0


def test_the_shared_prefix_of_a_rebuilt_digest_counts_shared_objects_then_equal_ones() -> None:
    # a rebuilt digest holds its parent's entry objects, then entries of its own equal to some
    parent = entries("a", "ra", "b", "rb")
    rebuilt = [*parent[:3], *entries("rb", "c")]
    assert rebuilt[:3] == parent[:3] and rebuilt[3] is not parent[3]
    assert shared_prefix(parent, rebuilt) == 4  # three shared objects, then one equal entry
    assert shared_prefix(parent, [*parent[:2], *entries("x", "rb")]) == 2  # differs past the shared objects
    assert shared_prefix(parent, parent[:3]) == 3
    assert shared_prefix(parent, [*parent, *entries("c")]) == 4  # every object shared


def test_a_difference_stores_the_entries_after_the_shared_ones() -> None:
    parent = entries("a", "ra", "b")
    stored = as_difference(record("a", "ra", "b", "rb", "c"), "r-1", parent)
    assert stored is not None
    assert (stored.digest, stored.digest_parent, stored.digest_shared) == (entries("rb", "c"), "r-1", 3)
    assert stored.reply == entries("reply")  # everything else as it was
    rewritten = as_difference(record("a", "ra", "x"), "r-1", parent)
    assert rewritten is not None and (rewritten.digest, rewritten.digest_shared) == (entries("x"), 2)
    assert as_difference(record("summary", "c"), "r-1", parent) is None  # nothing shared: stored whole
    # the stored JSON says it: the parent, the count, the tail
    doc = stored.model_dump(mode="json")
    assert (doc["digest_parent"], doc["digest_shared"], [e["sha256"] for e in doc["digest"]]) == (
        "r-1", 3, [e.sha256 for e in entries("rb", "c")])


def test_rebuild_follows_a_chain_to_a_whole_record_or_a_known_one() -> None:
    r0 = record("a")
    r1 = as_difference(record("a", "ra", "b"), "r0", r0.digest or [])
    r2 = as_difference(record("a", "ra", "b", "rb", "c"), "r1", entries("a", "ra", "b"))
    r3 = as_difference(record("a", "ra", "x"), "r2", entries("a", "ra", "b", "rb", "c"))  # shares 2
    assert r1 and r2 and r3
    whole = rebuild({"r0": r0, "r1": r1, "r2": r2, "r3": r3}, {})
    assert [whole[r].digest for r in ("r0", "r1", "r2", "r3")] == [
        entries("a"), entries("a", "ra", "b"), entries("a", "ra", "b", "rb", "c"), entries("a", "ra", "x")]
    assert all(w.digest_parent is None and w.digest_shared is None for w in whole.values())
    assert whole["r0"] is r0  # a whole record is given back as it is
    # the caller holds r1 whole: r2 and r3 need nothing else
    from_known = rebuild({"r2": r2, "r3": r3}, {"r1": entries("a", "ra", "b")})
    assert from_known["r3"].digest == entries("a", "ra", "x") and from_known["r2"].digest == whole["r2"].digest


def test_a_broken_chain_leaves_no_digest_never_a_wrong_one() -> None:
    r1 = as_difference(record("a", "ra", "b"), "gone", entries("a"))
    r2 = as_difference(record("a", "ra", "b", "rb", "c"), "r1", entries("a", "ra", "b"))
    assert r1 and r2
    whole = rebuild({"r1": r1, "r2": r2}, {})
    for rid in ("r1", "r2"):
        assert whole[rid].digest is None and whole[rid].digest_parent is None
    assert whole["r1"].digest_error == "the stored digest's parent record gone is missing"
    assert whole["r2"].digest_error == "the stored digest's parent record r1 is missing"
    looped = as_difference(record("a", "b"), "r9", entries("a"))  # a loop is never written; it ends too
    assert looped is not None
    assert rebuild({"r9": looped.model_copy(update={"digest_parent": "r9"})}, {})["r9"].digest is None


def test_a_baseline_reference_is_its_record_and_the_reply() -> None:
    ref = BaselineRef(record_id="r2", reply=entries("rc"))
    assert BaselineRef.model_validate_json(ref.model_dump_json()) == ref
    assert ref.model_dump(mode="json") == {"record_id": "r2", "reply": [
        {"role": "assistant", "sha256": entries("rc")[0].sha256}]}
