"""The inspector end to end: a real daemon (subprocess) ran real CLI chats in real sandboxes
against the loopback fixture; Debian's headless Chromium reads the operator page, and
`cloud-agent inspect` diagnoses the same turns.

Scenarios are data: each one drives a chat and states the rows its timeline must show and
the conclusion `inspect` must reach per turn. The wire-gap case is a real one: the member's
native transcript is edited between two turns (the daemon is a subprocess, so the proxy's
test seam of tests/regression/test_wire_gap.py cannot be used here), and the RESTORED turn's
request carries the changed first message; the page then shows its first-difference cell.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from deploy.loopback import LoopbackFixture
from tests.browser.browser import (
    NARROW,
    WIDE,
    artifacts_dir,
    chromium,
    console_errors,
    full_page_screenshot,
    low_contrast,
)
from tests.daemon_harness import TOKEN, daemon_process

pytestmark = [pytest.mark.browser, pytest.mark.cli, pytest.mark.docker]

NEW_CONCLUSION = "first turn of the member: there was no earlier history to send"
LOST_CONCLUSION = "session LOST (volume_missing): the chat's state volume is gone, and the native state with it"


@dataclass
class Chat:
    http: httpx.Client
    runtime: str
    user_id: str = field(default_factory=lambda: f"user-{uuid.uuid4().hex[:6]}")
    chat_id: str = field(default_factory=lambda: f"chat-{uuid.uuid4().hex[:6]}")
    member_id: str = "m1"
    receipts: list[dict[str, Any]] = field(default_factory=list)

    def turn(self, message: str) -> dict[str, Any]:
        job = {"job_id": f"job-{uuid.uuid4().hex[:10]}", "user_id": self.user_id, "chat_id": self.chat_id,
               "member_id": self.member_id, "runtime": self.runtime, "message": message}
        with self.http.stream("POST", "/v1/jobs", json=job) as resp:
            lines = [json.loads(line) for line in resp.iter_lines() if line.strip()]
        receipt = next(e["receipt"] for e in lines if e.get("type") == "receipt")
        self.receipts.append(receipt)
        return receipt

    def retire(self) -> None:
        resp = self.http.post(f"/v1/users/{self.user_id}/chats/{self.chat_id}/members/{self.member_id}/retire")
        assert resp.json() == {"retired": True}


def lifecycle(chat: Chat, docker_client: Any) -> None:
    """NEW -> LIVE -> (retire) RESTORED -> (container and state volume removed) LOST."""
    chat.turn("remember the word heron")
    chat.turn("and now the word lark")
    chat.retire()
    chat.turn("which words did I ask you to remember?")
    docker_client.api.remove_container(chat.receipts[-1]["sandbox"]["container_id"], force=True)
    docker_client.api.remove_volume(chat.receipts[-1]["sandbox"]["volume"])
    chat.turn("are you still there?")


def resident(chat: Chat, docker_client: Any) -> None:
    """One settled turn; the member stays resident in its running sandbox."""
    chat.turn("a bystander chat that keeps its resident")


GAP_FIRST, GAP_CHANGED = "remember the word heron", "remember the word crow!"


def gap(chat: Chat, docker_client: Any) -> None:
    """NEW; the member retired and its Codex rollout edited (the first message changed); RESTORED."""
    chat.turn(GAP_FIRST)
    chat.retire()
    container = docker_client.containers.get(chat.receipts[-1]["sandbox"]["container_id"])
    edit = ('for f in $(find /home/agent/members -name "rollout-*.jsonl"); do '
            f'sed -i "s/{GAP_FIRST}/{GAP_CHANGED}/g" "$f"; done')
    assert container.exec_run(["sh", "-c", edit], user="agent").exit_code == 0
    chat.turn("which word did I ask you to remember?")


def settled_conclusion(receipt: dict[str, Any]) -> str:
    """Before the wire verdict exists the diagnosis says it is unverified; with it, complete."""
    if receipt.get("wire"):
        return "history complete on the wire: a model claim, not a loss"
    return (f"session {receipt['context_status']} on {receipt['locator_after']}; the wire verdict is not "
            "available, so what the model was sent is unverified")


@dataclass
class Scenario:
    name: str
    runtime: str
    drive: Callable[[Chat, Any], None]
    rows: list[tuple[str, str, str | None]]  # (badge, outcome, reason) per turn, in order
    conclusions: Callable[[list[dict[str, Any]]], list[str]]  # inspect's conclusion per turn


SCENARIOS = [
    Scenario("lifecycle", "codex", lifecycle,
             rows=[("NEW", "succeeded", None), ("LIVE", "succeeded", None), ("RESTORED", "succeeded", None),
                   ("LOST", "refused", "volume_missing")],
             conclusions=lambda rs: [NEW_CONCLUSION, settled_conclusion(rs[1]), settled_conclusion(rs[2]),
                                     LOST_CONCLUSION]),
    Scenario("resident", "codex", resident, rows=[("NEW", "succeeded", None)],
             conclusions=lambda rs: [NEW_CONCLUSION]),
    Scenario("gap", "codex", gap, rows=[("NEW", "succeeded", None), ("RESTORED", "succeeded", None)],
             conclusions=lambda rs: [NEW_CONCLUSION, "wire gap at message 0 (user): the model was not sent its "
                                                     "history"]),
]


@dataclass
class Host:
    url: str
    token_file: Path
    chats: dict[str, Chat]


@pytest.fixture(scope="module")
def host(tmp_path_factory, sandbox_image, docker_client) -> Iterator[Host]:
    home = tmp_path_factory.mktemp("inspector") / "home"
    with LoopbackFixture.start() as fx, daemon_process(home, fx.base_url, sandbox_image) as dp:
        chats: dict[str, Chat] = {}
        with httpx.Client(base_url=dp.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=600) as http:
            for sc in SCENARIOS:
                chat = Chat(http, sc.runtime)
                sc.drive(chat, docker_client)
                got = [(r["context_status"], r["outcome"], r["reason"]) for r in chat.receipts]
                assert got == sc.rows, (sc.name, [(r["reason"], r["settlement"]) for r in chat.receipts])
                chats[sc.name] = chat
            yield Host(url=dp.url, token_file=home / "token", chats=chats)


# -- the page -----------------------------------------------------------------------------------


def wait_ready(driver: Any, page: str) -> None:
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(driver, 30).until(
        lambda d: d.execute_script("return document.getElementById('view').dataset.ready") == page
        or d.find_element("id", "message").is_displayed())
    assert driver.execute_script("return document.getElementById('view').dataset.ready") == page, \
        driver.find_element("id", "message").text


def sign_in(driver: Any, url: str, token: str) -> None:
    driver.get(f"{url}/ui/")
    box = driver.find_element("id", "token-input")
    box.send_keys(token)
    driver.find_element("css selector", "#token-form button[type=submit]").click()


def open_chat(driver: Any, url: str, chat: Chat) -> None:
    driver.get(f"{url}/ui/#/chat/{chat.user_id}/{chat.chat_id}")
    wait_ready(driver, "chat")


def rows(driver: Any) -> list[dict[str, Any]]:
    return driver.execute_script("""
      return [...document.querySelectorAll('#timeline > .turn')].map((li) => ({
        id: li.id, status: li.dataset.status, job: li.dataset.job,
        badge: li.querySelector('.badge').textContent,
        outcome: li.querySelector('.outcome').textContent,
        reason: li.querySelector('.reason strong') ? li.querySelector('.reason strong').textContent : null,
        wire: [...li.querySelectorAll('.facts > dt')].find((dt) => dt.textContent === 'Wire')
                .nextElementSibling.textContent }));""")


@pytest.fixture(scope="module")
def browser(host) -> Iterator[Any]:
    with chromium(WIDE) as driver:
        sign_in(driver, host.url, TOKEN)
        wait_ready(driver, "host")
        yield driver


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_timeline_shows_the_turns_in_order_with_badges_and_reasons(browser, host, scenario) -> None:
    chat = host.chats[scenario.name]
    open_chat(browser, host.url, chat)
    got = rows(browser)
    assert [(r["badge"], r["outcome"], r["reason"]) for r in got] == scenario.rows
    assert [r["status"] for r in got] == [b for b, _, _ in scenario.rows]
    assert [r["job"] for r in got] == [r["job_id"] for r in chat.receipts]
    for r, receipt in zip(got, chat.receipts, strict=True):
        wire = receipt.get("wire")
        assert r["wire"] == ("not available" if not wire else
                             f"{wire['history']} · {wire['requests']} request(s), {wire['side_requests']} side")
    title = browser.find_element("id", "timeline-title").text
    assert title == f"Timeline · {len(scenario.rows)} turn{'s' if len(scenario.rows) > 1 else ''}"
    assert console_errors(browser) == []


def test_the_gap_row_names_the_first_difference(browser, host) -> None:
    import hashlib

    chat = host.chats["gap"]
    diff = chat.receipts[1]["wire"]["first_difference"]
    assert diff == {"index": 0, "role": "user", "expected_digest": hashlib.sha256(GAP_FIRST.encode()).hexdigest(),
                    "observed_digest": hashlib.sha256(GAP_CHANGED.encode()).hexdigest()}
    open_chat(browser, host.url, chat)
    browser.find_element("css selector", "#turn-2 button.diagnose").click()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 30).until(lambda d: d.find_elements("css selector", "#turn-2 .conclusion"))
    assert browser.find_element("css selector", "#turn-2 .conclusion").text == (
        "Conclusion: wire gap at message 0 (user): the model was not sent its history")
    page = browser.find_element("css selector", "#turn-2").text
    assert diff["expected_digest"][:12] in page and diff["observed_digest"][:12] in page, page
    assert console_errors(browser) == []


def test_the_lost_row_diagnoses_like_inspect(browser, host) -> None:
    open_chat(browser, host.url, host.chats["lifecycle"])
    browser.find_element("css selector", "#turn-4 button.diagnose").click()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 30).until(lambda d: d.find_elements("css selector", "#turn-4 .conclusion"))
    assert browser.find_element("css selector", "#turn-4 .conclusion").text == f"Conclusion: {LOST_CONCLUSION}"
    steps = browser.execute_script("""
      return [...document.querySelectorAll('#turn-4 .step-head')].map((p) =>
        [p.querySelector('strong').textContent, p.querySelector('.verdict').textContent]);""")
    # a refused turn sends nothing: its wire verdict is "none", which the request step reads as no problem
    lost = host.chats["lifecycle"].receipts[3]
    assert lost["wire"]["history"] == "none" and lost["wire"]["requests"] == 0
    assert steps == [["Route", "problem"], ["Session identity", "unknown"], ["Native state", "unknown"],
                     ["Request", "ok"]]
    assert console_errors(browser) == []


def test_keyboard_reaches_every_row_in_order(browser, host) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    open_chat(browser, host.url, host.chats["lifecycle"])
    browser.execute_script("document.activeElement && document.activeElement.blur(); window.focus();")
    seen: list[str] = []
    for _ in range(40):
        ActionChains(browser).send_keys(Keys.TAB).perform()
        seen.append(browser.execute_script(
            "const a = document.activeElement; return a.id || a.className || a.tagName;"))
    turns = [s for s in seen if s.startswith("turn-")]
    assert turns[:4] == ["turn-1", "turn-2", "turn-3", "turn-4"], seen
    # the focus is visible: an outline of 3px on the focused row
    browser.find_element("id", "turn-2").click()
    browser.execute_script("document.getElementById('turn-1').focus()")
    outline = browser.execute_script("return getComputedStyle(document.activeElement).outlineWidth")
    assert outline == "3px"
    ActionChains(browser).send_keys(Keys.ARROW_DOWN).perform()
    assert browser.execute_script("return document.activeElement.id") == "turn-2"
    ActionChains(browser).send_keys(Keys.END).perform()
    assert browser.execute_script("return document.activeElement.id") == "turn-4"
    assert console_errors(browser) == []


def page_mib(n: int) -> str:
    """Bytes as the host page shows them (``(n / MB).toFixed(1)``): a tie goes to the larger
    number, where Python's format rounds it to even. An RSS is whole pages, so a reading of
    exactly x.25 MiB happens (1 in 256): 163.25 MiB is "163.3 MiB" on the page, and "163.2"
    by ``f"{n / 2**20:.1f}"``, the test's formatting until it failed CI so."""
    return f"{(Decimal(n) / 2**20).quantize(Decimal('0.1'), ROUND_HALF_UP)} MiB"


def test_the_page_formatting_of_memory_is_javascripts() -> None:
    assert [page_mib(n) for n in (171180032, 171704320, 171704320 - 4096, 0)] == [
        "163.3 MiB", "163.8 MiB", "163.7 MiB", "0.0 MiB"]  # 163.25, 163.75, 163.746..., 0


def test_host_page_lists_sandboxes_residents_and_attestation(browser, host) -> None:
    # the resident's memory is read on a period: wait for its first reading
    with httpx.Client(base_url=host.url, headers={"authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        def memory_view() -> tuple[dict, dict[str, str]]:
            view = http.get("/v1/host").json()
            return view, {r["chat_id"]: page_mib(r["memory_bytes"]) for r in view["residents"]}

        deadline = time.monotonic() + 30
        while True:
            view = http.get("/v1/host").json()
            if view["residents"] and all(r["memory_bytes"] is not None for r in view["residents"]):
                break
            assert time.monotonic() < deadline, view
            time.sleep(0.2)
        # A reading may land while the page loads (every 5 s): the page is compared with the
        # readings taken around its load, and loaded again when they differ.
        for _ in range(5):
            view, memory = memory_view()
            # a page left on this URL is not loaded again by a get of the same URL (only its
            # fragment): it would show the readings of the last attempt
            browser.get("about:blank")
            browser.get(f"{host.url}/ui/#/host")
            wait_ready(browser, "host")
            residents = browser.execute_script("""
              return [...document.querySelectorAll('#residents-table tbody tr')].map((tr) =>
                [...tr.querySelectorAll('td')].map((td) => td.textContent));""")
            if memory_view()[1] == memory:
                break
        else:
            raise AssertionError("the residents' memory changed during each of 5 page loads")
    cells = browser.execute_script("""
      return [...document.querySelectorAll('#sandboxes-table tbody tr')].map((tr) =>
        [...tr.querySelectorAll('td')].map((td) => td.textContent));""")
    by_chat = {c[1]: c for c in cells}
    life, res = host.chats["lifecycle"], host.chats["resident"]
    assert by_chat[life.chat_id][2] == "lost (volume_missing)"
    assert by_chat[res.chat_id][2] == "running"
    assert by_chat[res.chat_id][5] == res.receipts[-1]["sandbox"]["volume"]  # the chat's state volume
    # two chats keep a resident: the bystander and the wire-gap chat (its RESTORED turn's CLI)
    gap = host.chats["gap"]
    assert sorted((r[0], r[1], r[2], r[3], r[7]) for r in residents) == sorted([
        (res.user_id, res.chat_id, "m1", "codex", memory[res.chat_id]),
        (gap.user_id, gap.chat_id, "m1", "codex", memory[gap.chat_id])])
    budget = view["budget"]
    assert all(r["memory_bytes"] > 50 * 2**20 for r in view["residents"])  # codex trees
    assert budget["used_bytes"] >= max(r["memory_bytes"] for r in view["residents"])
    assert re.fullmatch(rf"Memory budget: \d+ MiB of {budget['limit_bytes'] / 2**20:.0f} MiB \(\d+%\)",
                        browser.find_element("css selector", "#budget p").text)
    assert browser.find_element("css selector", "#queue p").text == "Queue: 0 waiting"
    facts = browser.execute_script("""
      const out = {}; for (const dt of document.querySelectorAll('.host-layout dl > dt'))
        out[dt.textContent] = dt.nextElementSibling.textContent; return out;""")
    assert facts["Helper"] == "4 (required http-agent-live-bridge=4)"
    assert set(facts) == {"Source", "Image", "Helper", "Engine", "Reverse probe", "Heartbeat", "Ready"}
    # a sandbox's chat link opens its chat page
    browser.find_element("link text", life.chat_id).click()
    wait_ready(browser, "chat")
    assert [r["badge"] for r in rows(browser)] == ["NEW", "LIVE", "RESTORED", "LOST"]
    assert console_errors(browser) == []


def test_only_the_latest_navigation_renders(host) -> None:
    """Leaving a page before its data arrived: the late answer must not land on the next page."""
    from selenium.webdriver.support.ui import WebDriverWait

    life = host.chats["lifecycle"]
    with chromium(WIDE) as driver:
        sign_in(driver, host.url, TOKEN)
        wait_ready(driver, "host")
        open_chat(driver, host.url, life)
        count = "return performance.getEntriesByType('resource').filter((e) => e.name.endsWith('/v1/host')).length"
        before = driver.execute_script(count)
        # every request takes 800 ms more: the host page is still loading when the chat is asked for
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.emulateNetworkConditions", {"offline": False, "latency": 800,
                                                                     "downloadThroughput": -1, "uploadThroughput": -1})
        driver.execute_script(f"location.hash = '#/host'; setTimeout(() => "
                              f"{{ location.hash = '#/chat/{life.user_id}/{life.chat_id}'; }}, 100);")
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(count) > before)  # the host answer came
        wait_ready(driver, "chat")
        assert driver.find_elements("id", "host-title") == []
        assert [r["badge"] for r in rows(driver)] == ["NEW", "LIVE", "RESTORED", "LOST"]
        assert console_errors(driver) == []


def test_a_wrong_token_shows_a_clear_message(host) -> None:
    with chromium(NARROW) as driver:
        sign_in(driver, host.url, "not-the-token")
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(driver, 30).until(lambda d: d.find_element("id", "message").is_displayed())
        assert driver.find_element("id", "message").text == (
            "The service token was not accepted (HTTP 401). Paste the token from the file named by "
            "CLOUD_AGENT_SERVICE_TOKEN_FILE.")
        assert driver.find_element("id", "token-panel").is_displayed()
        assert driver.find_element("id", "view").text == ""
        assert driver.execute_script("return sessionStorage.length") == 0
        assert driver.switch_to.active_element.get_attribute("id") == "token-input"
        # the browser logs the refused request itself, and nothing else
        errors = console_errors(driver)
        assert errors and all("401 (Unauthorized)" in e["message"] for e in errors), errors
        sign_in(driver, host.url, TOKEN)
        wait_ready(driver, "host")
        assert not driver.find_element("id", "message").is_displayed()


@pytest.mark.parametrize(("name", "size"), [("narrow", NARROW), ("wide", WIDE)])
def test_screenshots_of_each_page(host, name, size) -> None:
    out = artifacts_dir()
    with chromium(size) as driver:
        sign_in(driver, host.url, TOKEN)
        wait_ready(driver, "host")
        assert low_contrast(driver) == []
        host_png = full_page_screenshot(driver, out / f"host-{name}.png", size[0])
        life = host.chats["lifecycle"]
        open_chat(driver, host.url, life)
        driver.find_element("css selector", "#turn-4 button.diagnose").click()
        from selenium.webdriver.support.ui import WebDriverWait

        WebDriverWait(driver, 30).until(lambda d: d.find_elements("css selector", "#turn-4 .conclusion"))
        layout = driver.execute_script(
            "return getComputedStyle(document.querySelector('.chat-layout')).gridTemplateColumns.split(' ').length")
        assert layout == (1 if name == "narrow" else 2)
        assert low_contrast(driver) == []
        chat_png = full_page_screenshot(driver, out / f"chat-{name}.png", size[0])
        assert console_errors(driver) == []
    for png in (host_png, chat_png):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    print(f"screenshots: {host_png} {chat_png}")


# -- cloud-agent inspect ------------------------------------------------------------------------


def inspect(host: Host, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, CLOUD_AGENT_URL=host.url, CLOUD_AGENT_SERVICE_TOKEN_FILE=str(host.token_file))
    return subprocess.run([sys.executable, "-m", "runner.cli", "inspect", *args], capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_inspect_reaches_each_turns_conclusion(host, scenario) -> None:
    chat = host.chats[scenario.name]
    expected = scenario.conclusions(chat.receipts)
    for n, conclusion in enumerate(expected, start=1):
        out = inspect(host, chat.user_id, chat.chat_id, "--turn", str(n))
        assert out.returncode == 0, out.stderr
        lines = out.stdout.splitlines()
        assert lines[0] == (f"inspect {chat.user_id}/{chat.chat_id} turn {n} · job {chat.receipts[n - 1]['job_id']}"
                            f" · member m1 ({scenario.runtime})")
        heads = [line.split(" — ")[0] for line in lines if line[:3] in ("1. ", "2. ", "3. ", "4. ")]
        assert heads == ["1. Route", "2. Session identity", "3. Native state", "4. Request"]
        assert lines[-1] == f"conclusion: {conclusion}"
        as_json = inspect(host, chat.user_id, chat.chat_id, "--turn", str(n), "--json")
        doc = json.loads(as_json.stdout)
        assert (doc["turn"], doc["conclusion"], doc["context_status"]) == (n, conclusion, scenario.rows[n - 1][0])
        assert [s["name"] for s in doc["steps"]] == ["route", "identity", "native_state", "request"]


def test_inspect_defaults_to_the_latest_turn_and_reads_the_native_state(host) -> None:
    life, res = host.chats["lifecycle"], host.chats["resident"]
    latest = json.loads(inspect(host, life.user_id, life.chat_id, "--json").stdout)
    assert (latest["turn"], latest["kind"], latest["reason"]) == (4, "lost", "volume_missing")
    route = latest["steps"][0]
    assert route["verdict"] == "problem"
    assert route["summary"] == "volume_missing: the chat's state volume is gone, and the native state with it"
    native = latest["steps"][2]["facts"]
    assert {"label": "now", "value": "not checked: sandbox LOST (volume_missing): not looked into"} in native
    # the resident chat's sandbox is running: one exec lists the member's rollout file
    doc = json.loads(inspect(host, res.user_id, res.chat_id, "--json").stdout)
    step = doc["steps"][2]
    assert step["verdict"] == "ok" and step["summary"].startswith("present now: 1 session file(s), ")
    files = [f["value"] for f in step["facts"] if f["label"] == "session file"]
    locator = res.receipts[0]["locator_after"]
    assert len(files) == 1 and f"-{locator}.jsonl (" in files[0] and "/.codex/sessions/" in files[0]
    text = inspect(host, res.user_id, res.chat_id).stdout
    assert "3. Native state — ok: present now: 1 session file(s)" in text


def test_inspect_errors_are_clear(host) -> None:
    life = host.chats["lifecycle"]
    beyond = inspect(host, life.user_id, life.chat_id, "--turn", "9")
    assert beyond.returncode == 1
    assert beyond.stderr.strip() == "error: HTTP 404: {'error': 'not_found', 'detail': 'no turn 9: the chat has 4'}"
    other = inspect(host, "someone-else", life.chat_id)
    assert other.returncode == 1 and other.stderr.strip() == "error: HTTP 404: {'error': 'not_found'}"
    zero = inspect(host, life.user_id, life.chat_id, "--turn", "0")
    assert zero.returncode == 1 and zero.stderr.strip() == "error: --turn must be 1 or more"
