"""Request-history regression matrix (SPEC 9.1): the five pinned CLIs x seven scenarios.

Full stack: daemon HTTP API -> runner -> retained sandbox -> real pinned CLI -> loopback
fixture. Every assertion is on what the fixture recorded: each conversational request of a
turn must carry exactly the expected user/assistant history (text, roles, order and
occurrences; CLI annotations such as Claude's system reminders, Codex's environment
context and Kilo's environment details are stripped by the audit), and the requests of each
turn are counted by kind (conversation / title / subagent / summary), so a side request can
never pass for the conversation or hide in it. A failure prints the audit's diff (expected
vs observed) and every request of the turn (``history_helpers.TurnResult.describe``).

Scenarios: 1 live follow-ups (a question asked twice), 2 immediate close/restore, 3 idle
stop/restore, 4 a transient error the CLI retries, 5 Claude's retry -> retire -> native
restore (plus the control run with retirement disabled), 6 a terminal rejection followed by
follow-ups, 7 a native fork at a historical turn. The context-window refusal under each native
compaction setting is tests/regression/test_compaction.py.

The suite shares one daemon and one loopback fixture per module (``tests/regression/
conftest.py``); each scenario has its own chat, and every fixture rule matches text unique
to its test. The matrix with each scenario's duration is printed at the end of the module.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import runner.turn
from deploy.loopback import Message, compare_history, cut, default_reply, fail, reject, user_texts
from proxy.digest import conversation_items
from tests.daemon_harness import RunningDaemon
from tests.regression.conftest import print_report, regression_daemon
from tests.regression.history_helpers import Member, TurnResult, token
from tests.support.metrics import sample

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]
RUNTIMES = ["claude", "codex", "pi", "opencode", "kilo"]

# ---------------------------------------------------------------- the matrix printout

_MATRIX: list[tuple[str, str, str, float]] = []


@pytest.fixture(scope="module", autouse=True)
def _matrix_report(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if not _MATRIX:
        return
    lines = ["request-history matrix (scenario, runtime, result, seconds):"]
    lines += [f"  {scenario:<62} {runtime:<9} {result:<5} {seconds:7.2f}" for scenario, runtime, result, seconds in _MATRIX]
    lines.append(f"  sum of scenario durations: {sum(s for *_, s in _MATRIX):.1f}s")
    print_report(request, lines)


@pytest.fixture(autouse=True)
def _timed(request: pytest.FixtureRequest) -> Iterator[None]:
    failed_before = request.session.testsfailed
    t0 = time.monotonic()
    yield
    params = request.node.callspec.params if hasattr(request.node, "callspec") else {}
    extra = "".join(f"[{k}={v}]" for k, v in params.items() if k != "runtime")
    result = "FAIL" if request.session.testsfailed > failed_before else "pass"
    _MATRIX.append((request.node.originalname.removeprefix("test_") + extra, params.get("runtime", "claude"),
                    result, time.monotonic() - t0))


# ---------------------------------------------------------------- 1. live follow-ups


# An annotation each CLI puts into its raw requests (the audit strips them; pi adds none
# to the messages): proof that the exact-history checks really see through annotations.
ANNOTATION = {"claude": "<system-reminder>", "codex": "<environment_context>", "pi": None,
              "opencode": "<system-reminder>", "kilo": "<environment_details>"}


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_live_followups(runtime: str, daemon: RunningDaemon, fx) -> None:
    """One resident process: NEW, then LIVE follow-ups. The same question is asked twice and
    both occurrences must be in the history (the fixture's answers to them differ only
    because the number of user messages differs). No side request is made by any CLI."""
    m = Member(daemon, fx, runtime)
    same = "Which colour is the sky on a clear day?"
    audited = await audited_messages(daemon)
    first = await m.turn(same, "NEW")
    marker = ANNOTATION[runtime]
    if marker is not None:
        assert marker in json.dumps(first.conversation[0].body), "the CLI's annotations are gone from its request"
    await m.turn("Name a prime number between 10 and 20.", "LIVE")
    await m.turn(same, "LIVE")
    last = await m.turn("Thanks, that is all.", "LIVE")
    assert user_texts(m.history).count(same) == 2 and len(m.history) == 8
    assert last.receipt["locator_before"] == first.receipt["locator_after"] == last.receipt["locator_after"]
    # the ledger kept each turn's request as what it added to the one before: the last reply and
    # this message (proxy.stored_digest), and the verdicts above were judged from those
    store = daemon.daemon.supervisor.store
    stored = [(row.record_id, row.digest_parent, json.loads(row.record_json)) for t in m.turns
              for row in await store.wire_records_of_job(m.user_id, m.chat_id, t.receipt["job_id"])]
    conversational = [(rid, parent, doc) for rid, parent, doc in stored if doc["route"] and not doc["side"]]
    assert [(len(doc["digest"]), doc["digest_shared"]) for _, _, doc in conversational] == [
        (1, None), (2, 1), (2, 3), (2, 5)], conversational
    assert [parent for _, parent, _ in conversational] == [None, *(rid for rid, _, _ in conversational[:-1])]
    assert [doc["digest_parent"] for _, _, doc in conversational] == [parent for _, parent, _ in conversational]
    # and the proxy audited each follow-up's messages shared with the request before it from
    # what it made of that request (proxy.audit_memo): at most its last two messages differ
    # (Claude moves its cache marker, Kilo its environment block), every other one is remembered
    sizes = [len(conversation_items(t.conversation[0].body, t.conversation[0].api) or []) for t in m.turns]
    after = await audited_messages(daemon)
    remembered = after["remembered"] - audited["remembered"]
    assert remembered >= sum(n - 2 for n in sizes[:-1]) > 0, (remembered, sizes)
    assert after["walked"] - audited["walked"] + remembered >= sum(sizes), (after, audited, sizes)


async def audited_messages(daemon: RunningDaemon) -> dict[str, float]:
    """The proxy's audited conversation messages so far, by how (relayed on the daemon's /metrics)."""
    text = (await daemon.client.get("/metrics")).text
    return {how: sample(text, "cloud_agent_proxy_audited_messages_total", how=how) or 0.0
            for how in ("walked", "remembered")}


# ---------------------------------------------------------------- 2. immediate close / restore


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_close_restore(runtime: str, daemon: RunningDaemon, fx) -> None:
    """The resident process is retired right after a turn settles (Claude's transcript
    flush window included); the next turn resumes the saved locator in the same container
    (RESTORED) with the whole history, and the turn after it is LIVE on that process."""
    m = Member(daemon, fx, runtime)
    first = await m.turn("Remember the word 'lantern'.", "NEW")
    await m.retire()
    assert (await m.member_status())["resident"] is False
    restored = await m.turn("Which word did I ask you to remember?", "RESTORED")
    live = await m.turn("Still there?", "LIVE")
    locator = first.receipt["locator_after"]
    for t in (restored, live):
        assert t.receipt["locator_before"] == locator == t.receipt["locator_after"]
        assert t.receipt["sandbox"]["container_id"] == first.receipt["sandbox"]["container_id"]


# ---------------------------------------------------------------- 3. idle stop / restore


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_idle_stop_restore(runtime: str, daemon: RunningDaemon, fx, docker_client) -> None:
    """The chat's container is stopped through the stop route (writable layer kept) and
    started again by the next turn, which resumes the saved locator (RESTORED)."""
    m = Member(daemon, fx, runtime)
    first = await m.turn("Plan: paint the fence.", "NEW")
    await m.turn("Then: water the plants.", "LIVE")
    container = first.receipt["sandbox"]["container_id"]
    await m.stop()
    assert docker_client.containers.get(container).status == "exited"
    status = await m.status()
    assert status["sandbox"]["state"] == "stopped" and status["members"][0]["resident"] is False
    restored = await m.turn("What was the plan?", "RESTORED")
    await m.turn("Good, carry on.", "LIVE")
    assert restored.receipt["sandbox"]["container_id"] == container
    assert restored.receipt["locator_before"] == first.receipt["locator_after"] == restored.receipt["locator_after"]


# ---------------------------------------------------------------- 4. a transient error the CLI retries

# Per CLI: the injected transient error, and the retry events the turn reports as
# (attempt, HTTP status). Every CLI retries inside the same native turn (the driver never
# resends the message): Claude (api_retry, CLAUDE_CODE_MAX_RETRIES=2) and pi (auto-retry,
# 1 s base delay; "overloaded" is in its retryable wording) get a 529 on the Anthropic API;
# Codex retries a 500 silently (no event); OpenCode/Kilo retry a 500 after the
# ``retry-after-ms`` delay and report the attempt without a status.
TRANSIENT: dict[str, tuple[dict[str, Any], list[tuple[int, int | None]]]] = {
    "claude": ({"status": 529}, [(1, 529)]),
    "codex": ({"status": 500}, []),
    "pi": ({"status": 529}, [(1, 529)]),
    "opencode": ({"status": 500, "retry_after_ms": 50}, [(1, None)]),
    "kilo": ({"status": 500, "retry_after_ms": 50}, [(1, None)]),
}


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_transient_error_retried(runtime: str, daemon: RunningDaemon, fx) -> None:
    """The fixture fails the turn's first model request once; the CLI really retries: two
    conversational requests for the turn (the error, then 200), both carrying the same
    history, and one successful settlement. The follow-up carries everything; it is LIVE
    except for Claude, whose process is retired after a turn with api_retry (SPEC 6)."""
    m = Member(daemon, fx, runtime)
    await m.turn("Start: list three fruits.", "NEW")
    spec, retries = TRANSIENT[runtime]
    flaky = token("flaky")
    fx.add_rule(fail(spec["status"], retry_after_ms=spec.get("retry_after_ms"), match=flaky, times=1))
    t = await m.turn(f"Now a flaky one ({flaky}).", "LIVE", kinds={"conversation": 2})
    assert t.statuses() == [spec["status"], 200], t.describe()
    assert [(e["attempt"], e["status"]) for e in t.event_kinds("retry")] == retries, t.events
    await m.turn("After the flake: anything else?", "RESTORED" if runtime == "claude" else "LIVE")


# ---------------------------------------------------------------- 5. Claude: retry -> retire -> restore


# The delayed API error that follows the successfully retried reply, in the next turn of
# the same session: a terminal 400, or a second transient failure that outlasts Claude's
# retries (529 three times: CLAUDE_CODE_MAX_RETRIES=2), which settles as ``overloaded``.
# (A stream dropped after the reply's last delta is not used: 2.1.220 sometimes retries it
# and sometimes keeps the streamed text and fails, so the request count is not stable.)
DELAYED = ["reject_400", "overloaded_529"]


class RetrySequence:
    """The retry-defect sequence: turn 1's first request fails once with a 529 (Claude
    retries: ``api_retry``) and the reply succeeds; turn 2 meets the delayed error; turn 3
    follows up; then a retire and turn 4 on the restored process."""

    def __init__(self, fx, delayed: str) -> None:
        flaky, bad = token("flaky"), token("delayed")
        self.delayed = delayed
        self.retried = f"First question, answered after a retry ({flaky})."
        self.failing = f"Second question, meets a delayed error ({bad})."
        self.follow = "Third: the follow-up after the error."
        self.restored = "Fourth: after the restore."
        exact = f"^{re.escape(self.failing)}$"
        later = reject(match=exact, regex=True) if delayed == "reject_400" else fail(529, match=exact, regex=True)
        fx.add_rules(fail(529, match=flaky, times=1), later)

    async def first(self, m: Member) -> TurnResult:
        """Turn 1 (NEW): the 529, Claude's retry (``api_retry`` in the events), the reply."""
        t = await m.turn(self.retried, "NEW", kinds={"conversation": 2})
        assert t.statuses() == [529, 200], t.describe()
        assert [(e["attempt"], e["status"]) for e in t.event_kinds("retry")] == [(1, 529)], t.events
        self.retried_turn = t
        return t

    async def second(self, m: Member, status: str) -> TurnResult:
        """Turn 2: the delayed error, a settled failure; Claude keeps the failed prompt and
        merges it into the next user message (failed + "\n" + next)."""
        if self.delayed == "reject_400":
            t = await m.failed_turn(self.failing, status, "api_error")
            assert t.event_kinds("retry") == [], t.events
        else:
            t = await m.failed_turn(self.failing, status, "overloaded", kinds={"conversation": 3},
                                    statuses=[529, 529, 529])
            assert [(e["attempt"], e["status"]) for e in t.event_kinds("retry")] == [(1, 529), (2, 529)], t.events
        assert "API Error" in (t.receipt["settlement"]["detail"] or ""), t.describe()
        self.failed_turn = t
        return t

    def follow_up(self, m: Member) -> list[Message]:
        """What the follow-up must carry."""
        return [*m.history, Message.user(self.failing + "\n" + self.follow)]


def drop_and_merge(history: list[Message], dropped: Message) -> list[Message]:
    """``history`` without the first ``dropped`` message, consecutive user messages then
    merged the way Claude sends them (joined with "\n")."""
    out: list[Message] = []
    rest = list(history)
    rest.remove(dropped)
    for msg in rest:
        if out and msg.role == "user" and out[-1].role == "user":
            out[-1] = Message.user(out[-1].text + "\n" + msg.text)
        else:
            out.append(msg)
    return out


@pytest.mark.parametrize("delayed", DELAYED)
async def test_claude_retry_retires_then_restores_full_history(delayed: str, daemon: RunningDaemon, fx) -> None:
    """SPEC 6, the fixed path: a turn with a successful internal retry (``api_retry``, in
    its events) settles, its verified locator is saved, and the runner retires the process
    after the commit (the status route shows the member not resident, the saved locator and
    the receipt). The next turn resumes the same session in the same container (RESTORED) —
    here it meets the delayed API error that damages the transcript of a process that had
    retried — and the LIVE follow-up and a later native restore carry the complete history."""
    m = Member(daemon, fx, "claude")
    seq = RetrySequence(fx, delayed)
    t = await seq.first(m)
    member = await m.member_status()
    assert member["resident"] is False, member  # retired after the commit
    assert (member["settled_turns"], member["locator"]["id"], member["last_outcome"]) == (
        1, t.receipt["locator_after"], "succeeded")
    assert t.receipt["job_id"] in [r["job_id"] for r in (await m.status())["last_receipts"]]
    second = await seq.second(m, "RESTORED")
    assert second.receipt["locator_before"] == t.receipt["locator_after"] == second.receipt["locator_after"]
    # a turn with api_retry is retired even when it settles as a failure; one without keeps its process
    retried_again = seq.delayed == "overloaded_529"
    assert (await m.member_status())["resident"] is not retried_again
    await m.turn(seq.follow, "RESTORED" if retried_again else "LIVE", expected=seq.follow_up(m))
    await m.retire()
    await m.turn(seq.restored, "RESTORED")
    assert user_texts(m.history)[0] == seq.retried


async def test_claude_silent_rerequest_keeps_live_and_restores_full_history(daemon: RunningDaemon, fx) -> None:
    """SPEC 6, "a turn without a retry keeps its LIVE process": a reply stream that ends
    cleanly after one text delta without ``message_stop`` makes 2.1.220 request the reply
    again SILENTLY (two conversational requests, no ``api_retry`` event), so the driver does
    not ask for retirement and the next turn is LIVE. The same delayed 400 afterwards does
    not damage the transcript (observed): the native restore carries the complete history."""
    m = Member(daemon, fx, "claude")
    await m.turn("Plain first question.", "NEW")
    again, bad = token("again"), token("bad")
    fx.add_rules(cut(after_deltas=1, match=again, times=1))
    t = await m.turn(f"Answered on the second request ({again}).", "LIVE", kinds={"conversation": 2})
    assert t.statuses() == [200, 200] and t.event_kinds("retry") == [], t.describe()
    assert t.conversation[0].action == "cut" and (await m.member_status())["resident"] is True
    failing = f"Rejected next ({bad})."
    fx.add_rule(reject(match=f"^{re.escape(failing)}$", regex=True))
    await m.failed_turn(failing, "LIVE", "api_error")
    follow = "The follow-up."
    await m.turn(follow, "LIVE", expected=[*m.history, Message.user(failing + "\n" + follow)])
    await m.retire()
    await m.turn("After the restore.", "RESTORED")


@pytest.fixture(scope="module")
async def control_daemon(fx, sandbox_image: str, docker_client: Any,
                         tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningDaemon]:
    """A daemon whose runner never retires a process after api_retry (test seam)."""
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("control"),
                                 hooks=runner.turn.TestHooks(disable_retire_after=True)) as d:
        yield d


@pytest.mark.parametrize("delayed", DELAYED)
async def test_claude_retry_defect_control_without_retirement(delayed: str, control_daemon: RunningDaemon,
                                                              fx) -> None:
    """CONTROL RUN — what pinned Claude Code 2.1.220 does when the runner does NOT retire the
    process after ``api_retry`` (``TestHooks(disable_retire_after=True)``); the same
    sequence as the fixed path. Observed, and pinned by the assertions below:

    1. turn 1: the first request gets a 529, Claude retries (``api_retry``), the reply a1
       succeeds; the process stays resident;
    2. turn 2, same process: the delayed API error (a 400, or three 529s that outlast the
       retries: a failure with api_retry of its own);
    3. the LIVE continuation is CORRECT: [u1, a1, u2 + "\n" + u3];
    4. the native restore (``--resume`` after a retire) DROPS a1, the retried reply. Claude
       then merges the now adjacent user messages, so the first user message no longer
       exists on its own: [u1 + "\n" + u2 + "\n" + u3, a3, u4] — the reproduction's "first
       user message missing".
       Mechanism (read from the transcript during the investigation): when the delayed
       error is written, 2.1.220 appends a ``system`` entry whose ``parentUuid`` is the entry
       BEFORE the retried reply, and the next user entry hangs off it, so the resumed parent
       chain skips the reply. (Seen while investigating, not asserted here: with the retry
       on a later turn, that turn's reply is dropped instead; a stream dropped after the
       last delta as the delayed error does the same when 2.1.220 does not retry it.)

    If a Claude pin stops reproducing this, the test fails and prints the observed
    history. The suite's guarantee is the fixed path (the test above).
    """
    m = Member(control_daemon, fx, "claude")
    seq = RetrySequence(fx, delayed)
    await seq.first(m)
    assert (await m.member_status())["resident"] is True  # not retired: the seam is on
    await seq.second(m, "LIVE")
    await m.turn(seq.follow, "LIVE", expected=seq.follow_up(m))  # the LIVE continuation is intact
    complete = [*m.history, Message.user(seq.restored)]
    retried_reply = Message.assistant(seq.retried_turn.receipt["assistant_text"])
    defect = drop_and_merge(complete, retried_reply)
    await m.retire()
    restored = await m.send(seq.restored)
    observed = restored.conversation[-1].conversation() if restored.conversation else []
    diff = compare_history(complete, observed)
    report = f"observed restore, expected the 2.1.220 defect shape {defect}:\n{diff}\n{restored.describe()}"
    assert (restored.receipt["context_status"], restored.receipt["outcome"]) == ("RESTORED", "succeeded"), report
    assert restored.kinds() == {"conversation": 1}, report
    assert compare_history(defect, observed).ok, report
    assert not diff.ok and retried_reply not in observed and seq.retried not in user_texts(observed), report
    assert restored.receipt["assistant_text"] == default_reply(user_texts(defect))


# ---------------------------------------------------------------- 6. terminal rejection, context window

# What each CLI sends after a failed (rejected) prompt, besides every earlier successful
# message (measured on the pinned versions):
# * Claude keeps the failed prompt and merges it into the next user message
#   (failed + "\n" + next); its synthetic "API Error: 400 …" reply is not sent.
# * Codex, pi, OpenCode and Kilo keep the failed prompt as its own user message with no
#   assistant reply after it (two user messages in a row).
MERGES_FAILED_PROMPT = {"claude"}

# A context-window refusal and each CLI's native compaction (CLOUD_AGENT_NATIVE_COMPACTION off / on):
# tests/regression/test_compaction.py.


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_terminal_rejection_then_followup(runtime: str, daemon: RunningDaemon, fx) -> None:
    """A terminal API rejection (400) is a settled failure (``failed``, reason
    ``api_error``, locator kept, one request: not retried); the LIVE follow-up carries every
    earlier successful message plus the failed prompt as each CLI keeps it (see
    MERGES_FAILED_PROMPT), and the history just grows from there."""
    m = Member(daemon, fx, runtime)
    await m.turn("Good start: say hi.", "NEW")
    bad = f"Please fail this one ({token('reject')})."
    fx.add_rule(reject(match=f"^{re.escape(bad)}$", regex=True))
    rejected = await m.failed_turn(bad, "LIVE", "api_error")
    assert "fixture: request rejected (terminal)" in (rejected.receipt["settlement"]["detail"] or "")
    follow = "After the rejection: are you there?"
    if runtime in MERGES_FAILED_PROMPT:
        expected = [*m.history, Message.user(bad + "\n" + follow)]
    else:
        expected = [*m.history, Message.user(bad), Message.user(follow)]
    await m.turn(follow, "LIVE", expected=expected)
    await m.turn("And one more.", "LIVE")


# ---------------------------------------------------------------- 7. native fork at a historical turn

# The fork's first turn: Claude forks lazily when the new member's first turn starts
# (--resume PARENT --fork-session --resume-session-at …), so that turn is NEW; the others
# fork eagerly in the route and the first turn resumes the fork (RESTORED). The parent's
# next turn: the eager forks retire the parent's process first (one writer per native
# session), so it is RESTORED; Claude's parent keeps its LIVE process.
FORK_STATUS = {"claude": ("NEW", "LIVE")}
DEFAULT_FORK_STATUS = ("RESTORED", "RESTORED")


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_fork_at_historical_turn(runtime: str, daemon: RunningDaemon, fx) -> None:
    """Fork at turn 2 of 3 through the fork route: the fork's first request carries exactly
    the two-turn prefix, its next turn its own history; the parent continues unaffected
    (its next request carries all three turns, not the fork's)."""
    parent = Member(daemon, fx, runtime)
    await parent.turn("Fork test one: apples.", "NEW")
    await parent.turn("Fork test two: pears.", "LIVE")
    prefix = list(parent.history)
    third = await parent.turn("Fork test three: plums.", "LIVE")
    resp = await parent.fork("m2", at_turn=2)
    lazy = runtime == "claude"
    assert (resp["member_id"], resp["runtime"], resp["forked_from"], resp["at_turn"], resp["pending"]) == (
        "m2", runtime, "m1", 2, lazy), resp
    assert (resp["locator"] is None) == lazy and (lazy or resp["locator"]["id"] != third.receipt["locator_after"])
    fork_status, parent_status = FORK_STATUS.get(runtime, DEFAULT_FORK_STATUS)
    fork = parent.sibling("m2", prefix)
    first = await fork.turn("In the fork: which fruits so far?", fork_status)
    assert first.receipt["locator_after"] not in (None, third.receipt["locator_after"])
    await fork.turn("In the fork again: and now?", "LIVE")
    after = await parent.turn("In the parent: and now?", parent_status)
    assert after.receipt["locator_after"] == third.receipt["locator_after"]
    # settled_turns of the fork: every fork starts at the native turns it inherits (at_turn 2)
    # and counts its own on top (Claude's lazy fork too, though its first turn is NEW).
    members = {x["member_id"]: x for x in (await parent.status())["members"]}
    assert (members["m1"]["settled_turns"], members["m2"]["settled_turns"], members["m2"]["forked_from"]) == (
        4, 4, "m1"), members
