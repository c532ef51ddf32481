"""The wire verdict of one turn: did the model see the member's history? (SPEC 12).

A pure function of digests. ``history``:

* ``none`` — no conversational request of the turn reached the proxy;
* ``new`` — there is nothing to expect (the member's first turn; a fork's first turn is
  instead compared with the source's conversation at the fork point, given as ``baseline``);
* ``complete`` — the turn's first conversational request starts with the baseline (the
  member's last conversational request before this turn, then that turn's reply), its last
  user text is this job's message unchanged, and each later conversational request of the
  turn extends the one before it;
* ``gap`` — any of that fails: ``first_difference`` names the first index and role that
  differ (digests only);
* ``compacted`` — as ``gap``, but the driver saw the CLI's own compaction in this turn.

After a settled failure there is no reply to expect (``Baseline.reply`` is empty). Some CLIs
fold the failed query into the next user message; each such behaviour is a named
:class:`Tolerance`, applied only to the CLIs it was measured on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, Field

from .records import DigestEntry, WireRecord, common_prefix

History = Literal["new", "complete", "gap", "compacted", "none"]


class FirstDifference(BaseModel):
    index: int = Field(description="position in the request's conversation digest")
    role: Literal["user", "assistant"]
    expected_digest: str | None = None
    observed_digest: str | None = Field(default=None, description="None: the request ends before this index")
    check: Literal["history", "message", "extension"] = Field(
        description="history: the baseline prefix; message: the job's message as the last user text; "
                    "extension: a later request of the turn does not extend the one before")
    request_seq: int | None = Field(default=None, description="the record whose digest differs")


class WireVerdict(BaseModel):
    requests: int = Field(description="requests of the turn the proxy forwarded")
    side_requests: int = Field(description="of those, side requests (probes, titles, summaries, …)")
    history: History
    first_difference: FirstDifference | None = None
    tolerances: list[str] = Field(default_factory=list, description="named tolerances the verdict relied on")


class Baseline(BaseModel):
    """What a turn's first conversational request must start with."""

    conversation: list[DigestEntry] = Field(description="the last conversational request before this turn")
    reply: list[DigestEntry] = Field(default_factory=list, description="that turn's reply; empty after a failure")

    @property
    def expected(self) -> list[DigestEntry]:
        return [*self.conversation, *self.reply]


def baseline_after(records: Sequence[WireRecord], *, succeeded: bool) -> Baseline | None:
    """The baseline a turn leaves for the next one; None when it had no conversational request
    (then the member's earlier baseline still holds)."""
    conv = [r for r in sorted(records, key=lambda r: r.seq) if r.conversational and r.digest is not None]
    if not conv:
        return None
    last = conv[-1]
    # entries already validated (the records'): a long chat's conversation is hundreds of them,
    # and validating each again (its digest's pattern) was most of the judge at 800 messages
    return Baseline.model_construct(conversation=list(last.digest or []),
                                    reply=list(last.reply or []) if succeeded else [])


# ---------------------------------------------------------------- tolerances


@dataclass(frozen=True)
class Expectation:
    prefix: list[DigestEntry]
    message: DigestEntry
    tolerances: tuple[str, ...] = ()


@dataclass(frozen=True)
class Tolerance:
    """A measured CLI behaviour that changes what the first request of a turn carries."""

    name: str
    runtimes: frozenset[str]
    description: str
    expect: Callable[[list[DigestEntry], str, Sequence[str]], Expectation | None]


def _fold_failed_queries(expected: list[DigestEntry], message: str, failed: Sequence[str]) -> Expectation | None:
    if not failed:
        return None
    folded_before = DigestEntry.text("user", "\n".join(failed))
    if not expected or expected[-1] != folded_before:
        return None
    return Expectation(prefix=expected[:-1], message=DigestEntry.text("user", "\n".join([*failed, message])),
                       tolerances=(FOLDS_FAILED_QUERY.name,))


FOLDS_FAILED_QUERY = Tolerance(
    name="folds_failed_query",
    runtimes=frozenset({"claude"}),
    description='Claude 2.1.220 merges a prompt whose turn failed into the next user message as '
                '"<failed>\\n<next>" (several failed prompts in a row chain the same way); the failed '
                "turn's last request already carried the earlier ones folded.",
    expect=_fold_failed_queries,
)

TOLERANCES: tuple[Tolerance, ...] = (FOLDS_FAILED_QUERY,)


def tolerances_for(runtime: str | None) -> list[Tolerance]:
    return [t for t in TOLERANCES if runtime in t.runtimes]


# ---------------------------------------------------------------- checks


def _prefix_difference(expected: Sequence[DigestEntry], observed: Sequence[DigestEntry], check: str,
                       seq: int) -> FirstDifference | None:
    i = common_prefix(expected, observed)
    if i == len(expected):
        return None
    want, got = expected[i], observed[i] if i < len(observed) else None
    return FirstDifference(index=i, role=want.role, expected_digest=want.sha256,
                           observed_digest=got.sha256 if got else None, check=check, request_seq=seq)  # type: ignore[arg-type]


def _check_first(exp: Expectation, observed: list[DigestEntry], seq: int) -> FirstDifference | None:
    diff = _prefix_difference(exp.prefix, observed, "history", seq)
    if diff is not None:
        return diff
    # the last user message after the prefix (the prefix itself is history, checked above)
    last = next((i for i in range(len(observed) - 1, len(exp.prefix) - 1, -1) if observed[i].role == "user"), None)
    if last is not None and observed[last] == exp.message:
        return None
    index = len(exp.prefix) if last is None else last
    got = observed[index] if index < len(observed) else None
    return FirstDifference(index=index, role="user", expected_digest=exp.message.sha256,
                           observed_digest=got.sha256 if got else None, check="message", request_seq=seq)


def wire_verdict(records: Sequence[WireRecord], *, baseline: Baseline | None, message: str,
                 failed_before: Sequence[str] = (), compaction: bool = False,
                 runtime: str | None = None) -> WireVerdict:
    """The verdict of one turn from its records.

    ``baseline``: :func:`baseline_after` of the member's previous turn with a conversational
    request (None for a first turn; a fork's first turn gets the source's baseline at the fork
    point). ``failed_before``: the messages of the settled-failed turns right before this one
    that reached the model (oldest first). ``compaction``: the driver saw the CLI's own
    compaction evidence in this turn. ``runtime`` selects the named tolerances.
    """
    ordered = sorted(records, key=lambda r: r.seq)
    forwarded = [r for r in ordered if r.route is not None]
    conv = [r for r in forwarded if r.conversational and r.digest is not None]
    counts = {"requests": len(forwarded), "side_requests": sum(r.side for r in forwarded)}
    if not conv:
        return WireVerdict(**counts, history="none")
    if baseline is None:
        return WireVerdict(**counts, history="new")

    first = list(conv[0].digest or [])
    expected = baseline.expected
    candidates = [Expectation(prefix=expected, message=DigestEntry.text("user", message))]
    for tol in tolerances_for(runtime):
        alt = tol.expect(expected, message, failed_before)
        if alt is not None:
            candidates.append(alt)
    diffs = [(_check_first(c, first, conv[0].seq), c) for c in candidates]
    passed = [c for d, c in diffs if d is None]
    applied: list[str] = []
    difference: FirstDifference | None = None
    if passed:
        applied = list(passed[0].tolerances)
    else:  # report the expectation the request matched furthest
        difference = max((d for d, _ in diffs if d is not None), key=lambda d: d.index)
    if difference is None:
        for before, after in zip(conv, conv[1:], strict=False):
            difference = _prefix_difference(before.digest or [], after.digest or [], "extension", after.seq)
            if difference is not None:
                break
    if difference is None:
        return WireVerdict(**counts, history="complete", tolerances=applied)
    return WireVerdict(**counts, history="compacted" if compaction else "gap", first_difference=difference,
                       tolerances=applied)
