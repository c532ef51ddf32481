"""The members' last baselines kept parsed (runner.baseline_cache): taken only for the very text
they were made from, bounded, least recently used out first."""

from __future__ import annotations

from proxy import Baseline, DigestEntry
from runner.baseline_cache import BaselineCache

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
