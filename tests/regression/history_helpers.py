"""Helpers of the request-history regression matrix (tests/regression/test_history.py).

A :class:`Member` drives one chat member through the real daemon and keeps the exact
user/assistant history its CLI must send to the model. Every turn records all fixture
requests made while it ran (:class:`TurnResult`), so a test can check each conversational
request of the turn (a retried turn has two) and count the side requests by kind.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Callable
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from deploy.loopback import LoopbackFixture, Message, RecordedRequest, compare_history, default_reply, user_texts
from tests.daemon_harness import RunningDaemon
from tests.regression.supervisor_text import SentFrame, assert_annotations_are_the_clis, assert_wire_adds_nothing
from tests.supervisor_helpers import high_water

# HEAD preconnects (Claude's ``HEAD /api/hello``) are not model requests.
NOT_MODEL = {"probe"}


def token(label: str) -> str:
    """A string unique to one test: rules on the shared fixture match on it."""
    return f"{label}-{uuid.uuid4().hex[:8]}"


@dataclass
class TurnResult:
    message: str
    receipt: dict[str, Any]
    events: list[dict[str, Any]]
    requests: list[RecordedRequest]
    seconds: float
    sent: list[SentFrame] = field(default_factory=list)  # every line the supervisor wrote to the CLI

    @property
    def conversation(self) -> list[RecordedRequest]:
        return [r for r in self.requests if r.kind == "conversation"]

    def kinds(self) -> dict[str, int]:
        """How many model requests of each kind this turn made (probes excluded)."""
        return dict(Counter(r.kind for r in self.requests if r.kind not in NOT_MODEL))

    def statuses(self) -> list[int]:
        return [r.status for r in self.conversation]

    def event_kinds(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("type") == "event" and e.get("kind") == kind]

    def describe(self) -> str:
        r = self.receipt
        lines = [f"turn {self.message!r}: status={r.get('context_status')} outcome={r.get('outcome')} "
                 f"reason={r.get('reason')} ({self.seconds:.2f}s)",
                 f"  assistant_text={r.get('assistant_text')!r} detail={(r.get('settlement') or {}).get('detail')!r}"]
        for q in self.requests:
            if q.kind in NOT_MODEL:
                continue
            lines.append(f"  request seq={q.seq} kind={q.kind} api={q.api} status={q.status} action={q.action} "
                         f"reply={q.reply_text!r}")
            if q.kind == "conversation":
                lines += [f"    {m}" for m in q.dialogue()]
        return "\n".join(lines)


@dataclass
class Member:
    """One member of one chat, driven through the daemon's job API."""

    d: RunningDaemon
    fx: LoopbackFixture
    runtime: str
    user_id: str = field(default_factory=lambda: f"user-{uuid.uuid4().hex[:8]}")
    chat_id: str = field(default_factory=lambda: f"chat-{uuid.uuid4().hex[:8]}")
    member_id: str = "m1"
    history: list[Message] = field(default_factory=list)
    turns: list[TurnResult] = field(default_factory=list)

    @property
    def base(self) -> str:
        return f"/v1/users/{self.user_id}/chats/{self.chat_id}"

    def sibling(self, member_id: str, history: list[Message]) -> Member:
        """Another member of the same chat (a fork) with its own expected history."""
        return Member(self.d, self.fx, self.runtime, user_id=self.user_id, chat_id=self.chat_id,
                      member_id=member_id, history=list(history))

    def job(self, message: str) -> dict[str, Any]:
        return {"job_id": f"job-{uuid.uuid4().hex}", "user_id": self.user_id, "chat_id": self.chat_id,
                "member_id": self.member_id, "runtime": self.runtime, "message": message}

    async def send(self, message: str, *, check_added_nothing: bool = True) -> TurnResult:
        """Run one job; every turn is held to SPEC 9.1's "the supervisor adds nothing" (the wire
        to the CLI and the annotations the model saw) unless a test checks that itself."""
        mark = high_water(self.fx)
        wire_mark = self.d.wire.mark
        t0 = time.monotonic()
        receipt, events, resp = await self.d.run(self.job(message))
        seconds = time.monotonic() - t0
        assert resp.status_code == 200 and receipt is not None, (resp.status_code, events)
        requests = [r for r in self.fx.requests() if r.seq > mark]
        turn = TurnResult(message, receipt, events, requests, seconds, self.d.wire.since(wire_mark))
        if not turn.conversation:
            # the fixture saw no conversational request of this turn: neither did the proxy
            assert_wire(turn, "none", self.runtime)
        self.turns.append(turn)
        if check_added_nothing:
            assert_added_nothing(turn, self.runtime)
        return turn

    def first_on_the_wire(self, t: TurnResult) -> bool:
        """No earlier turn of this member reached the model and it inherits no history."""
        return not self.history and not any(e.conversation for e in self.turns if e is not t)

    def fixture_verdict(self, t: TurnResult, expected: list[Message]) -> str:
        """What the fixture's exact audit says of a turn whose first request carried ``expected``:
        ``new`` / ``complete``; ``compacted`` when a later request no longer carries it and the
        fixture saw the CLI ask for a summary in this turn (its own compaction)."""
        if self.first_on_the_wire(t):
            return "new"
        later_ok = all(compare_history(expected, r.conversation()[:len(expected)]).ok for r in t.conversation[1:])
        summarised = any(r.kind == "summary" for r in t.requests)
        return "compacted" if summarised and not later_ok else "complete"

    async def turn(self, message: str, status: str, *, kinds: dict[str, int] | None = None,
                   expected: list[Message] | None = None,
                   transform: Callable[[list[Message]], list[Message]] | None = None) -> TurnResult:
        """A turn that must succeed, every conversational request carrying the whole history.

        The expected request is ``history + [user message]`` unless ``expected`` says
        otherwise (e.g. a CLI that merges a failed message into this one); the fixture's
        default reply for it is then appended to ``history``. ``kinds``: the exact request
        count by kind (default: one conversation request and no side request).
        """
        expected = [*self.history, Message.user(message)] if expected is None else expected
        reply = default_reply(user_texts(expected))
        t = await self.send(message)
        ctx = f"[{self.runtime}] {t.describe()}"
        assert (t.receipt["context_status"], t.receipt["outcome"]) == (status, "succeeded"), ctx
        assert t.kinds() == (kinds or {"conversation": 1}), ctx
        assert_requests(t, expected, self.runtime, transform=transform)
        if transform is None:  # the fixture's audit says complete: so must the product's verdict
            assert_wire(t, "new" if self.first_on_the_wire(t) else "complete", self.runtime)
        assert t.receipt["assistant_text"] == reply, ctx
        self.history = [*expected, Message.assistant(reply)]
        return t

    async def failed_turn(self, message: str, status: str, reason: str, *, kinds: dict[str, int] | None = None,
                          statuses: list[int] | None = None,
                          checked_apart: frozenset[int] = frozenset()) -> TurnResult:
        """A turn the model API rejects: a settled failure that keeps the locator.

        Every conversational request of the turn (the CLI's own retries too) must carry
        ``history + [message]``, except those whose indexes are in ``checked_apart``: the caller
        checks those itself (a CLI's compaction retry carries a summary instead). ``history`` is
        NOT extended (what the CLI keeps of a failed turn differs per CLI: the caller says).
        """
        t = await self.send(message)
        ctx = f"[{self.runtime}] {t.describe()}"
        r = t.receipt
        assert (r["context_status"], r["outcome"], r["reason"]) == (status, "failed", reason), ctx
        assert r["settlement"]["is_error"] is True and r["settlement"]["evidence"], ctx
        assert r["locator_before"] is not None and r["locator_after"] == r["locator_before"], ctx
        assert t.kinds() == (kinds or {"conversation": 1}), ctx
        assert t.statuses() == (statuses or [400]), ctx
        expected = [*self.history, Message.user(message)]
        assert_failed_requests(t, expected, self.runtime, checked_apart)
        assert_wire(t, self.fixture_verdict(t, expected), self.runtime, difference=None)
        return t

    async def status(self) -> dict[str, Any]:
        resp = await self.d.client.get(self.base)
        assert resp.status_code == 200, resp.text
        return resp.json()

    async def member_status(self) -> dict[str, Any]:
        return next(m for m in (await self.status())["members"] if m["member_id"] == self.member_id)

    async def retire(self) -> None:
        resp = await self.d.client.post(f"{self.base}/members/{self.member_id}/retire")
        assert (resp.status_code, resp.json()) == (200, {"retired": True}), resp.text

    async def stop(self) -> None:
        resp = await self.d.client.post(f"{self.base}/stop")
        assert (resp.status_code, resp.json()) == (200, {"stopped": True}), resp.text

    async def fork(self, new_member_id: str, at_turn: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"new_member_id": new_member_id}
        if at_turn is not None:
            body["at_turn"] = at_turn
        resp = await self.d.client.post(f"{self.base}/members/{self.member_id}/fork", json=body)
        assert resp.status_code == 200, resp.text
        return resp.json()


def assert_wire(t: TurnResult, history: str, runtime: str, *, difference: bool | None = False) -> None:
    """Two witnesses agree (SPEC 9.1, 12): the receipt's wire verdict is what the fixture's
    exact audit of the same turn says, and its request counts are the fixture's.
    ``difference``: whether the receipt names a first difference (None: as ``history`` implies)."""
    wire = t.receipt.get("wire")
    ctx = f"[{runtime}] receipt wire={wire}\n{t.describe()}"
    assert wire is not None and wire["history"] == history, ctx
    named = history in ("gap", "compacted") if difference is None else difference
    assert (wire["first_difference"] is not None) == named, ctx
    model = [r for r in t.requests if r.kind not in NOT_MODEL]
    assert wire["requests"] - wire["side_requests"] == len(t.conversation), ctx
    assert wire["side_requests"] >= len(model) - len(t.conversation), ctx


def assert_added_nothing(t: TurnResult, runtime: str) -> None:
    """SPEC 9.1: nothing but the user's message went to the CLI, and the model saw no annotation
    the pinned CLI does not add itself (tests/regression/allowed_injections.py)."""
    assert_wire_adds_nothing(t.sent, [t.message])
    assert_annotations_are_the_clis([r for r in t.requests if r.kind not in NOT_MODEL], runtime)


def assert_requests(t: TurnResult, expected: list[Message], runtime: str, *, which: slice = slice(None),
                    transform: Callable[[list[Message]], list[Message]] | None = None) -> None:
    """Every conversational request of the turn (or those selected by ``which``) carries
    exactly ``expected`` (user/assistant; ``transform`` is applied to the observed history
    first, e.g. :func:`mark_summaries`).

    The failure message is the audit's diff plus every request of the turn.
    """
    assert t.conversation, f"[{runtime}] no conversational request recorded\n{t.describe()}"
    for i, req in list(enumerate(t.conversation))[which]:
        observed = req.conversation()
        if transform is not None:
            observed = transform(observed)
        diff = compare_history(expected, observed)
        if not diff.ok:
            raise AssertionError(f"[{runtime}] conversational request {i + 1}/{len(t.conversation)} "
                                 f"(seq {req.seq}) of turn {t.message!r}:\n{diff}\n--- the turn:\n{t.describe()}")


def assert_failed_requests(t: TurnResult, expected: list[Message], runtime: str,
                           checked_apart: frozenset[int] = frozenset()) -> None:
    """Every conversational request of a failed turn but those in ``checked_apart`` carries
    exactly ``expected``; an index in ``checked_apart`` must exist (nothing is skipped by accident)."""
    assert all(0 <= i < len(t.conversation) for i in checked_apart), \
        f"[{runtime}] checked_apart {sorted(checked_apart)} of {len(t.conversation)} requests\n{t.describe()}"
    for i in range(len(t.conversation)):
        if i not in checked_apart:
            assert_requests(t, expected, runtime, which=slice(i, i + 1))


# ---------------------------------------------------------------- compaction summaries

# How each CLI wraps a compaction summary into its model history (measured on the pinned
# versions; the fixture's summary reply is "Fixture summary of N user message(s).").
# Claude 2.1.220 also names the transcript path inside the wrapper, so the wrapper text
# between the fixed sentences is matched loosely; the summary itself exactly.
_SUMMARY = r"(?P<summary>Fixture summary of \d+ user message\(s\)\.)"
SUMMARY_WRAPPERS = {
    "claude": re.compile(
        r"\AThis session is being continued from a previous conversation that ran out of context\. "
        r".*?\n\n" + _SUMMARY + r"\n\n.*?Pick up the last task as if the break never happened\.(?:\n|\Z)", re.DOTALL),
    "codex": re.compile(
        r"\AAnother language model started to solve this problem and produced a summary of its thinking "
        r"process\..*?\n" + _SUMMARY + r"\Z", re.DOTALL),
    "pi": re.compile(
        r"\AThe conversation history before this point was compacted into the following summary:\n\n"
        r"<summary>\n" + _SUMMARY + r"\n</summary>\Z"),
}


def summary_marker(summary: str) -> str:
    return f"[compaction summary: {summary}]"


def mark_summaries(runtime: str) -> Callable[[list[Message]], list[Message]]:
    """Replace the CLI's summary wrapper in user messages by ``summary_marker(summary)``
    (whatever follows the wrapper in the same message is kept verbatim)."""
    pattern = SUMMARY_WRAPPERS.get(runtime)

    def transform(messages: list[Message]) -> list[Message]:
        if pattern is None:
            return messages
        return [Message.user(pattern.sub(lambda mo: summary_marker(mo["summary"]) + ("\n" if mo[0].endswith("\n")
                                                                                     else ""), m.text, count=1))
                if m.role == "user" else m for m in messages]

    return transform
