"""Two witnesses agree on a loss (SPEC 12, issue 12): the proxy's test seam drops or edits one
earlier message of a turn's request before it is audited and forwarded — standing in for a CLI
that lost its history — and the receipt's wire verdict is ``gap`` naming exactly that index and
role, while the fixture's own audit of the same request finds the same message missing.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

import pytest

from deploy.loopback import Message, compare_history, default_reply
import runner.turn
from tests.regression.conftest import regression_daemon
from tests.regression.history_helpers import Member, assert_requests, token

pytestmark = [pytest.mark.regression, pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

RUNTIMES = ["claude", "codex", "pi", "opencode", "kilo"]


def _text(item: dict[str, Any]) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def _set_text(item: dict[str, Any], old: str, new: str) -> None:
    if isinstance(item.get("content"), str):
        item["content"] = item["content"].replace(old, new)
        return
    for part in item["content"]:
        if isinstance(part, dict) and old in part.get("text", ""):
            part["text"] = part["text"].replace(old, new)


class Seam:
    """Changes the request of the turn that carries ``trigger``: ``drop`` removes the message
    whose text holds ``target``; ``edit`` replaces ``target`` inside it."""

    def __init__(self) -> None:
        self.trigger = self.target = ""
        self.mode = "drop"
        self.applied = 0

    def __call__(self, route: str, body: bytes) -> bytes:
        if not self.trigger or self.trigger.encode() not in body:
            return body
        doc = json.loads(body)
        items = doc.get("messages") if isinstance(doc.get("messages"), list) else doc.get("input")
        hit = next(i for i, item in enumerate(items) if isinstance(item, dict)
                   and item.get("role") in ("user", "assistant") and self.target in _text(item))
        if self.mode == "drop":
            del items[hit]
        else:
            _set_text(items[hit], self.target, "EDITED BY THE TEST SEAM")
        self.applied += 1
        return json.dumps(doc).encode()


@pytest.fixture(scope="module")
def seam() -> Seam:
    return Seam()


@pytest.fixture(scope="module")
async def gap_daemon(fx, sandbox_image, docker_client, tmp_path_factory, seam):
    hooks = runner.turn.TestHooks(rewrite_model_request=seam)
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("gap"),
                                 hooks=hooks) as d:
        yield d


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@pytest.mark.parametrize("mode", ["drop", "edit"])
@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_a_changed_history_is_a_gap_at_that_index_and_role(runtime: str, mode: str, gap_daemon, fx,
                                                                seam: Seam) -> None:
    m = Member(gap_daemon, fx, runtime)
    first, second, third = token("first"), token("second"), token("third")
    await m.turn(first, "NEW")
    await m.turn(second, "LIVE")
    reply_1 = default_reply([first])
    seam.trigger, seam.mode, seam.applied = third, mode, 0
    seam.target = first if mode == "drop" else reply_1
    try:
        t = await m.send(third)
    finally:
        seam.trigger = ""
    assert seam.applied >= 1
    r = t.receipt
    assert (r["context_status"], r["outcome"]) == ("LIVE", "succeeded"), t.describe()
    # the product's witness: the first difference is the changed message, by index and role
    if mode == "drop":
        want = {"index": 0, "role": "user", "expected_digest": sha(first), "observed_digest": sha(reply_1)}
    else:
        want = {"index": 1, "role": "assistant", "expected_digest": sha(reply_1),
                "observed_digest": sha("EDITED BY THE TEST SEAM")}
    assert r["wire"]["history"] == "gap" and r["wire"]["first_difference"] == want, (r["wire"], t.describe())
    # the fixture's witness: the same request lacks the same message
    expected = [*m.history, Message.user(third)]
    observed = t.conversation[0].conversation()
    assert not compare_history(expected, observed).ok
    changed: Callable[[Message], bool] = (lambda x: x.text == first) if mode == "drop" else (
        lambda x: x.text == reply_1)
    assert [x for x in observed if changed(x)] == []
    with pytest.raises(AssertionError):
        assert_requests(t, expected, runtime)


async def test_the_inspector_shows_a_gaps_texts_from_a_capture_stored_as_differences(
        fx, sandbox_image, docker_client, tmp_path_factory) -> None:
    """Capture on: each request's record kept only the texts after those it shares with the
    member's previous one. A gap in the 12th turn at the first reply: that reply's text is held
    only by the 1st and 2nd turns' records, beyond the inspector's 8 earlier turns; it follows
    the 12th turn's record's parents to it (runner.captured_texts)."""
    seam = Seam()
    hooks = runner.turn.TestHooks(rewrite_model_request=seam)
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("gap-capture"),
                                 hooks=hooks, wire_capture=True) as d:
        m = Member(d, fx, "pi")
        first = token("first")
        await m.turn(first, "NEW")
        for i in range(2, 12):
            await m.turn(token(f"turn {i}"), "LIVE")
        reply_1, last = default_reply([first]), token("last")
        seam.trigger, seam.mode, seam.target = last, "edit", reply_1
        t = await m.send(last)
        assert seam.applied >= 1
        wire = t.receipt["wire"]
        assert wire["history"] == "gap" and wire["first_difference"] == {
            "index": 1, "role": "assistant", "expected_digest": sha(reply_1),
            "observed_digest": sha("EDITED BY THE TEST SEAM")}, wire
        # the ledger: the 12th request stored as a difference (shares only the first message)
        (row,) = await d.daemon.supervisor.store.wire_records_of_job(m.user_id, m.chat_id, t.receipt["job_id"])
        captured = json.loads(row.capture_json or "{}")["request"]
        assert (json.loads(row.record_json)["digest_shared"], len(captured)) == (1, 22)  # of 23 messages
        assert captured[0] == {"role": "assistant", "text": "EDITED BY THE TEST SEAM"}
        got = await d.client.get(f"{m.base}/inspect", params={"turn": 12})
        assert got.status_code == 200, got.text
        request = next(s for s in got.json()["steps"] if s["name"] == "request")
        facts = {f["label"]: f["value"] for f in request["facts"]}
        assert (facts["expected text"], facts["observed text"]) == (reply_1, "EDITED BY THE TEST SEAM"), facts
