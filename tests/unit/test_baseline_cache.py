"""The members' last baselines kept parsed (runner.baseline_cache): taken only for the very text
they were made from, bounded, least recently used out first."""

from __future__ import annotations

from proxy import Baseline, DigestEntry
from runner.baseline_cache import ENTRY_BYTES, BaselineCache, weight

M1, M2, M3 = ("u", "c", "m1"), ("u", "c", "m2"), ("u", "c", "m3")


def baseline(*texts: str) -> Baseline:
    return Baseline(conversation=[DigestEntry.text("user", t) for t in texts],
                    reply=[DigestEntry.text("assistant", "r-" + texts[-1])])


def test_a_kept_baseline_is_taken_for_its_own_text_only() -> None:
    cache, kept = BaselineCache(), baseline("a", "b")
    text = kept.model_dump_json()
    cache.keep(M1, text, kept)
    assert cache.parsed(M1, text) is kept
    older = baseline("a").model_dump_json()  # what the store holds after the commit rolled back
    got = cache.parsed(M1, older)
    assert got is not kept and got == baseline("a")
    assert cache.parsed(M1, older) is got  # the parse is kept in its place


def test_members_do_not_share_a_kept_baseline() -> None:
    cache, kept = BaselineCache(), baseline("a")
    text = kept.model_dump_json()
    cache.keep(M1, text, kept)
    other = cache.parsed(M2, text)
    assert other == kept and other is not kept


def test_the_least_recently_used_member_goes_first() -> None:
    cache = BaselineCache(size=2)
    kept = {m: baseline(m[2]) for m in (M1, M2, M3)}
    cache.keep(M1, kept[M1].model_dump_json(), kept[M1])
    cache.keep(M2, kept[M2].model_dump_json(), kept[M2])
    assert cache.parsed(M1, kept[M1].model_dump_json()) is kept[M1]  # M1 used: M2 is now the oldest
    cache.keep(M3, kept[M3].model_dump_json(), kept[M3])
    assert len(cache) == 2
    assert cache.parsed(M1, kept[M1].model_dump_json()) is kept[M1]
    assert cache.parsed(M3, kept[M3].model_dump_json()) is kept[M3]
    assert cache.parsed(M2, kept[M2].model_dump_json()) is not kept[M2]


def test_the_baselines_bytes_are_bounded_too() -> None:
    kept = {m: baseline(m[2]) for m in (M1, M2, M3)}
    texts = {m: b.model_dump_json() for m, b in kept.items()}
    assert len({len(t) for t in texts.values()}) == 1  # the same size each
    size = weight(texts[M1], kept[M1])
    assert size == len(texts[M1]) + 2 * ENTRY_BYTES  # the text, and one entry each of conversation and reply
    cache = BaselineCache(max_bytes=2 * size)
    for m in (M1, M2, M3):
        cache.keep(m, texts[m], kept[m])
    assert cache.members() == [M2, M3] and cache.kept_bytes == 2 * size  # M1, the oldest, went
    cache.keep(M2, texts[M2], kept[M2])  # kept again: counted once
    assert cache.members() == [M3, M2] and cache.kept_bytes == 2 * size
    big = baseline(*(f"turn {i}" for i in range(6)))  # a longer history: a longer text
    assert weight(big.model_dump_json(), big) > 2 * size
    cache.keep(M1, big.model_dump_json(), big)  # over the bound alone: not kept, nothing evicted
    assert cache.members() == [M3, M2] and cache.kept_bytes == 2 * size
    assert cache.parsed(M1, big.model_dump_json()) == big


def test_a_deleted_chat_s_members_go_and_no_one_else_s() -> None:
    cache = BaselineCache()
    others = [("u", "c2", "m1"), ("u2", "c", "m1")]  # another chat of the user; the same chat id of another user
    for m in (M1, M2, *others):
        b = baseline(m[2])
        cache.keep(m, b.model_dump_json(), b)
    assert cache.forget_chat("u", "c") == 2
    assert cache.members() == others
    assert cache.kept_bytes == sum(weight(baseline(m[2]).model_dump_json(), baseline(m[2])) for m in others)
    assert cache.forget_chat("u", "c") == 0


def test_a_reference_s_weight_is_its_digest_s_and_its_record_is_known() -> None:
    """A baseline stored as a reference (a short text) still counts its whole digest, and the
    member's kept baseline names the record its conversation is the whole digest of."""
    kept = baseline(*(f"turn {i}" for i in range(40)))
    ref = '{"record_id":"r-9","reply":[]}'
    cache = BaselineCache(max_bytes=40 * ENTRY_BYTES)  # less than its 41 entries
    cache.keep(M1, ref, kept, "r-9")
    assert len(cache) == 0 and cache.whole_digests(M1) == {}
    cache = BaselineCache()
    cache.keep(M1, ref, kept, "r-9")
    assert cache.kept_bytes == len(ref) + 41 * ENTRY_BYTES
    assert cache.whole_digests(M1) == {"r-9": kept.conversation} and cache.whole_digests(M2) == {}
    assert cache.get(M1, ref) is kept and cache.get(M1, '{"record_id":"r-8","reply":[]}') is None
    cache.keep(M2, kept.model_dump_json(), kept)  # stored whole: no record to name
    assert cache.whole_digests(M2) == {}
