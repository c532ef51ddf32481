"""One native-compaction policy for the five pinned CLIs (CLOUD_AGENT_NATIVE_COMPACTION), per runtime
and setting, on the full stack (daemon -> sandbox -> real CLI -> loopback fixture).

Each test: a settled turn, then a message the fixture refuses with a context-window 400
(``context_too_long`` rule), then a follow-up. Everything is asserted on the fixture's recorded
requests (counted by kind: conversation / summary / title) and on the receipts:

* **off** (the default): the refusal is the turn's ``context_too_long`` — one conversational
  request, no summary request, nothing retried — in this turn or the next; the follow-up carries
  the history verbatim (the refused prompt as the CLI keeps it) and nobody says ``compacted``.
* **on**: the CLI's own compaction is visible (its summary request, the summary in the next
  request's history) and the receipt of the turn in which it compacted says ``compacted``.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import pytest

from deploy.loopback import Message, context_too_long, default_reply, user_texts
from tests.daemon_harness import RunningDaemon
from tests.regression.conftest import regression_daemon
from tests.regression.history_helpers import Member, TurnResult, assert_requests, mark_summaries, summary_marker, token

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]
RUNTIMES = ["claude", "codex", "pi", "opencode", "kilo"]

# Claude keeps a refused prompt and merges it into the next user message (refused + "\n" + next);
# the other CLIs keep it as its own user message with no reply after it.
MERGES_FAILED_PROMPT = {"claude"}


@pytest.fixture(scope="module")
async def daemon_on(fx, sandbox_image: str, docker_client: Any,
                    tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningDaemon]:
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("compaction-on"),
                                 native_compaction="on") as d:
        yield d


def compacted(t: TurnResult) -> bool:
    return t.receipt["settlement"]["compacted"]


def reported_compacted(t: TurnResult) -> bool:
    """Both witnesses of SPEC 12: the driver's settlement and the proxy's wire verdict say so."""
    wire = t.receipt.get("wire") or {}
    return t.receipt["settlement"]["compacted"] and wire.get("history") == "compacted"


def summary_of(t: TurnResult) -> str:
    summaries = [r.reply_text for r in t.requests if r.kind == "summary"]
    assert len(summaries) == 1 and summaries[0], t.describe()
    return summaries[0]


async def refuse(m: Member, fx, kinds: dict[str, int],
                 checked_apart: frozenset[int] = frozenset()) -> tuple[str, TurnResult]:
    """A context-window refusal; every conversational request carries the history, except the
    ones in ``checked_apart`` (a compaction retry: the caller checks its summary)."""
    huge = f"Huge input ({token('huge')})."
    fx.add_rule(context_too_long(match=f"^{re.escape(huge)}$", regex=True))
    refused = await m.failed_turn(huge, "LIVE", "context_too_long", kinds=kinds,
                                  statuses=[400] * kinds["conversation"], checked_apart=checked_apart)
    return huge, refused


async def codex_compacts_at_the_next_turn(m: Member, fx, follow: str) -> None:
    """Codex: nothing more in the refused turn; the NEXT turn first compacts (a summary side
    request) and sends the user messages, the summary as a user message, then the new prompt. It
    does so whatever the policy (0.171 has no switch: drivers/codex/launch.py); it is reported."""
    before = list(m.history)
    huge, refused = await refuse(m, fx, {"conversation": 1})
    assert not compacted(refused), refused.describe()
    t = await m.send(follow)
    s = summary_marker(summary_of(t))
    expected = [Message.user(u) for u in user_texts(before)] + [Message.user(huge), Message.user(s),
                                                              Message.user(follow)]
    assert (t.receipt["context_status"], t.receipt["outcome"]) == ("LIVE", "succeeded"), t.describe()
    assert t.kinds() == {"conversation": 1, "summary": 1}, t.describe()
    assert_requests(t, expected, "codex", transform=mark_summaries("codex"))
    assert t.receipt["assistant_text"] == default_reply(user_texts(expected))
    assert reported_compacted(t), t.describe()
    m.history = [*expected, Message.assistant(t.receipt["assistant_text"])]


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_compaction_off_refusal_is_context_too_long(runtime: str, daemon: RunningDaemon, fx) -> None:
    m = Member(daemon, fx, runtime)
    await m.turn("Compaction off: say hi.", "NEW")
    follow = "After the refusal: still there?"
    if runtime == "codex":
        await codex_compacts_at_the_next_turn(m, fx, follow)
        await m.turn("And one more.", "LIVE", transform=mark_summaries(runtime))
        return
    before = list(m.history)
    huge, refused = await refuse(m, fx, {"conversation": 1})  # no summary request, no retry
    assert not compacted(refused), refused.describe()
    if runtime in MERGES_FAILED_PROMPT:
        expected = [*before, Message.user(huge + "\n" + follow)]
    else:
        expected = [*before, Message.user(huge), Message.user(follow)]
    after = await m.turn(follow, "LIVE", expected=expected)  # exactly one conversation request: no summary
    assert not compacted(after), after.describe()
    await m.turn("And one more.", "LIVE")


OPENCODE_SUMMARY = "Create a new anchored summary from the conversation history"


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_compaction_on_is_visible_and_reported(runtime: str, daemon_on: RunningDaemon, fx) -> None:
    m = Member(daemon_on, fx, runtime)
    await m.turn("Compaction on: say hi.", "NEW")
    await m.turn("Compaction on: and again.", "LIVE")
    before = list(m.history)
    mark = mark_summaries(runtime)
    follow = "After the context refusal: still there?"
    if runtime == "codex":
        await codex_compacts_at_the_next_turn(m, fx, follow)
    elif runtime == "claude":
        # reactive compaction inside the refused turn: conversation 400, summary, the retried
        # conversation 400 on [summary, the last reply, the refused prompt]
        huge, refused = await refuse(m, fx, {"conversation": 2, "summary": 1}, checked_apart=frozenset({1}))
        assert reported_compacted(refused), refused.describe()
        s = summary_marker(summary_of(refused))
        kept = [Message.user(s), before[-1]]
        assert_requests(refused, [*kept, Message.user(huge)], runtime, which=slice(1, 2), transform=mark)
        await m.turn(follow, "LIVE", expected=[*kept, Message.user(huge + "\n" + follow)], transform=mark)
    elif runtime == "pi":
        # overflow recovery inside the refused turn: a summary, then the prompt re-run on it
        huge, refused = await refuse(m, fx, {"conversation": 2, "summary": 1}, checked_apart=frozenset({1}))
        assert reported_compacted(refused), refused.describe()
        s = summary_marker(summary_of(refused))
        assert_requests(refused, [Message.user(s), *before, Message.user(huge)], runtime, which=slice(1, 2),
                        transform=mark)
        await m.turn(follow, "LIVE", expected=[Message.user(s), *before, Message.user(huge), Message.user(follow)],
                     transform=mark)
    else:
        # OpenCode/Kilo compact inside the refused turn: their own summary prompt (the fixture
        # counts it as a conversation request), a synthetic "What did we do so far?" user
        # message, the prompt retried on the rewritten history; the refusal still ends the turn
        huge = f"Huge input ({token('huge')})."
        fx.add_rule(context_too_long(match=f"^{re.escape(huge)}$", regex=True))
        refused = await m.send(huge)
        r = refused.receipt
        assert (r["context_status"], r["outcome"], r["reason"]) == ("LIVE", "failed", "context_too_long"), \
            refused.describe()
        assert reported_compacted(refused), refused.describe()
        summaries = [q for q in refused.conversation if OPENCODE_SUMMARY in q.conversation()[-1].text]
        assert summaries and summaries[0].conversation()[-1].text.count(before[0].text) == 1, refused.describe()
        retried = [q for q in refused.conversation if q.conversation()[-1].text == huge]
        assert len(retried) >= 2 and retried[1].conversation()[0] == Message.user("What did we do so far?"), \
            refused.describe()
        after = await m.send(follow)
        assert (after.receipt["context_status"], after.receipt["outcome"]) == ("LIVE", "succeeded"), after.describe()
        history = after.conversation[-1].conversation()
        assert history[-1] == Message.user(follow) and before[0] not in history, after.describe()  # rewritten
        return
    await m.turn("And one more.", "LIVE", transform=mark)
