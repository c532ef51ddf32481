"""The page's rendering functions in a real Chromium, over hand-built data: a wire gap row
(before the proxy's test seam exists), a receipt without a wire verdict, a diagnosis
produced by the Python side. The page's files are served as they are, from a loopback
static server: no daemon needed."""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from runner.diagnosis import diagnose
from runner.inspector_api import UI_DIR
from tests.browser.browser import chromium, console_errors
from tests.unit.test_diagnosis import GAP, evidence, receipt

pytestmark = pytest.mark.browser


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def page_url() -> Iterator[str]:
    handler = functools.partial(_Quiet, directory=str(UI_DIR))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/index.html"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(page_url):
    with chromium() as driver:
        driver.get(page_url)
        yield driver


RENDER_TURN = """
const [turn, done] = [arguments[0], arguments[arguments.length - 1]];
import("./timeline.js").then((m) => {
  const li = m.renderTurn(turn, { onDiagnose: () => {} });
  document.body.append(li);
  const q = (sel) => [...li.querySelectorAll(sel)].map((n) => n.textContent);
  const facts = {};
  for (const dt of li.querySelectorAll(".facts > dt")) facts[dt.textContent] = dt.nextElementSibling.textContent;
  done({ badge: q(".badge")[0], outcome: q(".outcome")[0], reason: q(".reason strong")[0] || null, facts,
         where: q(".diff-where"), digests: q(".diff-digest"), texts: q(".diff-text"),
         timing: li.querySelector(".timing-bar").getAttribute("aria-label"), status: li.dataset.status,
         focusable: li.tabIndex });
  li.remove();
}).catch((e) => done({ error: String(e) }));
"""

RENDER_DIAGNOSIS = """
const [d, done] = [arguments[0], arguments[arguments.length - 1]];
import("./timeline.js").then((m) => {
  const node = m.renderDiagnosis(d);
  done({ steps: [...node.querySelectorAll(".step-head")].map((n) => n.textContent),
         conclusion: node.querySelector(".conclusion").textContent });
}).catch((e) => done({ error: String(e) }));
"""


def turn_json(r: Any, wire: dict[str, Any] | None) -> dict[str, Any]:
    body = r.model_dump(mode="json")
    if wire is not None:
        body["wire"] = wire
    return {"index": 3, "job_id": r.job_id, "member_id": r.member_id, "state": "done",
            "started_at": body["started_at"], "receipt": body}


def test_a_wire_gap_row_shows_the_first_differing_message_digests_only(browser) -> None:
    out = browser.execute_async_script(RENDER_TURN, turn_json(receipt("RESTORED", "succeeded"), GAP))
    assert "error" not in out, out
    assert (out["badge"], out["outcome"], out["reason"], out["status"]) == ("RESTORED", "succeeded", None, "RESTORED")
    assert out["facts"]["Wire"] == "gap · 2 request(s), 1 side"
    assert out["where"] == ["message 3 (assistant)"]
    assert out["digests"] == ["expected " + "e" * 16 + "…", "observed " + "f" * 16 + "…"]
    assert out["texts"] == []  # capture off: no text
    assert out["timing"] == ("timings: sandbox 10 ms, process 200 ms, turn 900 ms, other 90 ms; total 1,200 ms")
    assert out["focusable"] == 0
    assert console_errors(browser) == []


def test_captured_texts_are_shown_when_the_receipt_carries_them(browser) -> None:
    captured = GAP | {"first_difference": GAP["first_difference"] | {"expected_text": "I said blue",
                                                                      "observed_text": "<b>red</b>"}}
    out = browser.execute_async_script(RENDER_TURN, turn_json(receipt("RESTORED", "succeeded"), captured))
    assert out["texts"] == ["expected text: I said blue", "observed text: <b>red</b>"]  # as text, never markup


def test_a_receipt_without_a_wire_verdict_says_not_available(browser) -> None:
    out = browser.execute_async_script(RENDER_TURN, turn_json(
        receipt("LOST", "refused", reason="container_missing", evidence=None), None))
    assert (out["badge"], out["outcome"], out["reason"]) == ("LOST", "refused", "container_missing")
    assert out["facts"]["Wire"] == "not available"
    assert out["facts"]["Settlement"] == "none"
    assert out["where"] == []


def test_the_page_renders_the_python_diagnosis_of_a_gap(browser) -> None:
    d = diagnose(evidence(receipt("RESTORED", "succeeded"), wire=GAP)).model_dump(mode="json")
    out = browser.execute_async_script(RENDER_DIAGNOSIS, d)
    assert out["steps"] == [
        "Route ok served by host-a, sandbox running",
        "Session identity ok settled on 0199aaaa-1111-7000-8000-000000000001 (result)",
        "Native state unknown not checked",
        "Request problem gap at message 3 (assistant): the model was not sent its history",
    ]
    assert out["conclusion"] == "Conclusion: wire gap at message 3 (assistant): the model was not sent its history"
    assert console_errors(browser) == []


RENDER_TREE = """
const [members, done] = [arguments[0], arguments[arguments.length - 1]];
import("./chat.js").then((m) => {
  const tree = m.memberTree(members);
  const walk = (ul) => [...ul.querySelectorAll(":scope > li")].map((li) => [li.dataset.member,
    li.querySelector(":scope > ul") ? walk(li.querySelector(":scope > ul")) : []]);
  done({ tree: walk(tree), badges: [...tree.querySelectorAll(".badge")].map((b) => b.textContent) });
}).catch((e) => done({ error: String(e) }));
"""


def test_members_render_as_their_fork_tree(browser) -> None:
    def member(mid: str, forked_from: str | None, status: str) -> dict[str, Any]:
        return {"member_id": mid, "runtime": "claude", "locator": {"id": f"loc-{mid}", "path": None},
                "settled_turns": 1, "last_status": status, "last_outcome": "succeeded", "resident": False,
                "forked_from": forked_from, "lost_reason": None}

    members = [member("m1", None, "LIVE"), member("m2", "m1", "NEW"), member("m3", "m2", "RESTORED"),
               member("m4", "m1", "LOST"), member("solo", None, "NEW")]
    out = browser.execute_async_script(RENDER_TREE, members)
    assert out["tree"] == [["m1", [["m2", [["m3", []]]], ["m4", []]]], ["solo", []]]
    assert out["badges"] == ["LIVE", "NEW", "RESTORED", "LOST", "NEW"]
    assert console_errors(browser) == []
