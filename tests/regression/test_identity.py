"""Identity regressions (SPEC 4.1-4.2, 9.2): for every runtime and both settled outcomes, a
locator that changes at settlement is rejected and the saved one is kept; a job naming a
locator other than the saved one is refused before any process starts.

One daemon for the module, one chat per runtime. The changed locator is injected by
:mod:`tests.regression.rewrite` (a test transport wrapper rewriting the session id in the
CLI's settlement evidence line of that one turn), never by editing the store. Per runtime:

1. NEW turn (succeeded) — the saved locator L.
2. LIVE turn with the rewrite, the fixture answers normally → failed/identity_mismatch,
   a settled success underneath (``is_error`` false), locator stays L in receipt and store.
3. next turn, no rewrite → RESTORED (the runner retired the process), succeeded on L, and
   the model sees the whole history (the mismatched turn was native history: the CLI had
   recorded it before the runner rejected its report).
4. LIVE turn with the rewrite, the fixture rejects it with a 400 → failed/identity_mismatch,
   a settled failure underneath (``is_error`` true), locator still L.
5. a job naming another locator → refused ``locator_mismatch`` with the member's real status
   (RESTORED: step 4 retired its process; SPEC 3), the member not condemned: zero fixture
   requests and not one exec in the container.
6. next turn → RESTORED, succeeded on L, the full history (the rejected query is native
   history; the error itself is not sent back to the model by any pinned CLI).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import anyio
import pytest

from deploy.loopback import Message, assert_history, default_reply, reject
from runner.turn import TestHooks as Hooks  # not collected as a test class
from tests.regression.conftest import regression_daemon
from tests.regression.rewrite import LocatorRewriter
from tests.supervisor_helpers import Chat, assert_model_saw, available_runtimes, high_water, last_conversation

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

EVIDENCE_LINE = {"claude": "result", "codex": "turn/completed", "pi": "get_state", "opencode": "settled",
                 "kilo": "settled"}
EVIDENCE = {"claude": "claude:result", "codex": "codex:turn/completed", "pi": "pi:agent_end+get_state",
            "opencode": "opencode:bridge.settled", "kilo": "kilo:bridge.settled"}


@pytest.fixture(scope="module")
def rewriter() -> LocatorRewriter:
    return LocatorRewriter()


@pytest.fixture(scope="module")
async def daemon(fx, rewriter, sandbox_image, docker_client, tmp_path_factory):
    """The module's daemon, every process's transport wrapped by ``rewriter`` (inert until armed)."""
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("identity"),
                                 hooks=Hooks(wrap_transport=rewriter.wrap), probe_interval_s=3600) as d:
        yield d


class IdentityChat(Chat):
    """A :class:`Chat` that also knows how a rejected query stays in the native history.

    Every pinned CLI keeps a rejected query and sends it again on the next turn, without the
    error. Claude 2.1.220 merges it into the next user message (two text blocks, the first
    ending in a newline: audited as ``failed + "\\n" + next``, see deploy/loopback/audit.py);
    the others send two user messages in a row.
    """

    def expect_rejected(self, message: str) -> None:
        self.history.append(Message.user(message))

    def model_view(self, history: list[Message]) -> list[Message]:
        out: list[Message] = []
        for m in history:
            if self.runtime == "claude" and out and m.role == out[-1].role == "user":
                out[-1] = Message.user(out[-1].text + "\n" + m.text)
            else:
                out.append(m)
        return out

    def expect_turn(self, message: str) -> str:
        self.history.append(Message.user(message))
        reply = default_reply([m.text for m in self.model_view(self.history) if m.role == "user"])
        self.history.append(Message.assistant(reply))
        return reply

    def expected_request(self) -> list[Message]:
        return self.model_view(self.history[:-1])


def forged_locator(runtime: str) -> str:
    return f"ses_forged{uuid.uuid4().hex[:16]}" if runtime in ("opencode", "kilo") else str(uuid.uuid4())


def exec_events(docker_client, container_id: str, t0: float, t1: float) -> list[dict[str, Any]]:
    """Every exec the engine created or started in the container between t0 and t1 (epoch s)."""
    events = docker_client.events(since=int(t0), until=int(t1) + 1, decode=True,
                                  filters={"type": "container", "container": container_id})
    return [e for e in events if str(e.get("Action", "")).startswith("exec_")
            and int(t0 * 1e9) <= e["timeNano"] <= int(t1 * 1e9)]


async def member_state(d, chat: IdentityChat) -> tuple[Any, int]:
    m = await d.daemon.supervisor.store.get_member(chat.user_id, chat.chat_id, chat.member_id)
    return (m.locator.id, m.locator.path), m.settled_turns


async def succeed(d, fx, chat: IdentityChat, message: str, status: str) -> dict[str, Any]:
    reply = chat.expect_turn(message)
    mark = high_water(fx)
    receipt, events, _ = await d.run(chat.job(message))
    assert receipt is not None, events
    assert (receipt["context_status"], receipt["outcome"], receipt["reason"]) == (status, "succeeded", None), receipt
    assert receipt["assistant_text"] == reply
    assert_model_saw(fx, mark, chat)
    return receipt


async def mismatched(d, fx, rewriter: LocatorRewriter, chat: IdentityChat, message: str, saved: str,
                     *, rejected: bool) -> dict[str, Any]:
    """A LIVE turn whose settlement evidence reports a forged locator."""
    runtime = chat.runtime
    forged = forged_locator(runtime)
    before = await member_state(d, chat)
    reply = None
    if rejected:
        chat.expect_rejected(message)
    else:
        reply = chat.expect_turn(message)
    mark = high_water(fx)
    rewriter.arm(runtime, forged)
    try:
        receipt, events, _ = await d.run(chat.job(message))
    finally:
        rewrites = rewriter.disarm()
    assert receipt is not None, events
    # the wrapper changed exactly the evidence line(s) of this turn, from the saved id
    assert rewrites, "the settlement evidence line was never rewritten"
    assert {(r.kind, r.original, r.forged) for r in rewrites} == {(EVIDENCE_LINE[runtime], saved, forged)}
    assert (receipt["context_status"], receipt["outcome"], receipt["reason"]) == \
        ("LIVE", "failed", "identity_mismatch"), receipt
    assert (receipt["locator_before"], receipt["locator_after"]) == (saved, saved)
    settlement = receipt["settlement"]
    assert (settlement["evidence"], settlement["is_error"]) == (EVIDENCE[runtime], rejected), settlement
    assert forged in settlement["detail"] and saved in settlement["detail"]
    assert await member_state(d, chat) == before, "the durable locator must not move"
    # the turn really reached the model (it settled natively), exactly once as a conversation
    convs = [r for r in fx.requests(kind="conversation") if r.seq > mark]
    assert len(convs) == 1, [r.seq for r in convs]
    if rejected:
        assert_history(chat.model_view(chat.history), last_conversation(fx, mark))  # ends with the query
    else:
        assert_model_saw(fx, mark, chat)
        assert receipt["assistant_text"] == reply
    status = (await d.client.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()
    assert status["members"][0]["resident"] is False, "a process that reported another session is retired"
    return receipt


@pytest.mark.parametrize("runtime", available_runtimes())
async def test_changed_locator_at_settlement_is_rejected(runtime, daemon, fx, rewriter, docker_client) -> None:
    d = daemon
    chat = IdentityChat(runtime)
    first = await succeed(d, fx, chat, f"identity check one ({runtime})", "NEW")
    saved = first["locator_after"]
    assert saved and first["locator_before"] is None
    container = first["sandbox"]["container_id"]
    stored, turns = await member_state(d, chat)
    assert (stored[0], turns) == (saved, 1)

    # 2-3: a successful turn reporting another session; then the saved one is resumed
    await mismatched(d, fx, rewriter, chat, f"identity check two ({runtime})", saved, rejected=False)
    again = await succeed(d, fx, chat, f"identity check three ({runtime})", "RESTORED")
    assert (again["locator_before"], again["locator_after"]) == (saved, saved)
    assert await member_state(d, chat) == (stored, 2)

    # 4: a settled failure (400) reporting another session
    fx.add_rule(reject(match=f"identity check four ({runtime})", times=1, id=f"reject-{runtime}"))
    await mismatched(d, fx, rewriter, chat, f"identity check four ({runtime})", saved, rejected=True)
    assert await member_state(d, chat) == (stored, 2)

    # 5: a job naming another locator: refused before any process starts
    mark = high_water(fx)
    t0 = time.time()
    refused, _, resp = await d.run(chat.job("this must never reach a model", locator=forged_locator(runtime)))
    t1 = time.time()
    assert resp.status_code == 200
    assert (refused["context_status"], refused["outcome"], refused["reason"]) == ("RESTORED", "refused",
                                                                                  "locator_mismatch")
    assert (refused["locator_before"], refused["locator_after"]) == (saved, saved)
    assert fx.requests(since=mark) == [], "a refused launch must not reach the model"
    assert await anyio.to_thread.run_sync(exec_events, docker_client, container, t0, t1) == []
    assert await member_state(d, chat) == (stored, 2)

    # 6: the saved locator resumes with the whole native history
    t0 = time.time()
    last = await succeed(d, fx, chat, f"identity check five ({runtime})", "RESTORED")
    started = await anyio.to_thread.run_sync(exec_events, docker_client, container, t0, time.time())
    assert {"exec_create", "exec_start"} <= {e["Action"].split(":")[0] for e in started}, \
        "control: a launch shows up as execs (so the empty list above means none ran)"
    assert (last["locator_before"], last["locator_after"]) == (saved, saved)
    assert last["sandbox"]["container_id"] == container
    assert await member_state(d, chat) == (stored, 3)


HANDSHAKE_LINE = {"codex": "thread/resume", "pi": "get_state", "opencode": "opened", "kilo": "opened"}


# Claude's resume handshake (initialize) names no session; it proves its id at settlement (above).
@pytest.mark.parametrize("runtime", [r for r in available_runtimes() if r != "claude"])
async def test_resume_handshake_reporting_another_session_is_lost(runtime, daemon, fx, rewriter) -> None:
    """SPEC 3: the resume handshake reports another session → LOST: the message never reaches
    the CLI or the model, the saved locator is kept, and the member stays LOST."""
    d = daemon
    chat = IdentityChat(runtime)
    first = await succeed(d, fx, chat, f"handshake check one ({runtime})", "NEW")
    saved = first["locator_after"]
    resp = await d.client.post(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}/members/{chat.member_id}/retire")
    assert resp.json() == {"retired": True}
    forged = forged_locator(runtime)
    mark = high_water(fx)
    rewriter.arm(runtime, forged, at="handshake")
    try:
        refused, events, _ = await d.run(chat.job("this must never reach a model"))
    finally:
        rewrites = rewriter.disarm()
    assert {(r.kind, r.original, r.forged) for r in rewrites} == {(HANDSHAKE_LINE[runtime], saved, forged)}
    assert (refused["context_status"], refused["outcome"], refused["reason"]) == ("LOST", "refused",
                                                                                  "locator_mismatch"), refused
    assert (refused["locator_before"], refused["locator_after"]) == (saved, saved)
    assert [e for e in events if e.get("type") == "event"] == []
    assert fx.requests(since=mark) == [], "the message must not reach the model"
    status = (await d.client.get(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")).json()["members"][0]
    assert (status["lost_reason"], status["resident"], status["locator"]["id"]) == ("locator_mismatch", False, saved)
    again, _, _ = await d.run(chat.job("nor this one"))
    assert (again["context_status"], again["outcome"], again["reason"]) == ("LOST", "refused", "previously_lost")
    assert fx.requests(since=mark) == []
