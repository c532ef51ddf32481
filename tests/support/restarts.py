"""Daemon restarts with turns in flight (SPEC 14), through the HTTP API of daemon subprocesses:
the routine behind tests/cli/test_keeper_restart.py's restart matrix and
tests/bench/bench_keeper_restart.py.

Each round: every chat has a turn in flight (the fixture holds each reply mid-stream for
``hold_s``), the daemon is killed with ``kill -9`` and a new one starts. That daemon must
commit every held turn exactly once (``GET /v1/jobs`` answers 202 until then), with the reply
the fixture sent, and the next turn of every chat must be ``LIVE`` on the same native process.
At the end each chat's last request must carry every user message exactly once, in order, and
each held message must have reached the model in exactly one conversational request (the
model proxy outlives the daemon: SPEC 14).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx

from deploy.loopback import LoopbackFixture, stall
from tests.daemon_harness import TOKEN, daemon_process
from tests.supervisor_helpers import Chat

HEADERS = {"authorization": f"Bearer {TOKEN}"}


@dataclass
class RestartReport:
    live_ms: list[float] = field(default_factory=list)  # a LIVE turn before the restarts
    restored_ms: list[float] = field(default_factory=list)  # a RESTORED turn (after a retire)
    ready_ms: list[float] = field(default_factory=list)  # daemon spawn to /healthz
    first_live_ms: list[float] = field(default_factory=list)  # daemon spawn to its first LIVE receipt
    committed_once: int = 0  # held turns committed once, succeeded, with the held reply
    held: int = 0
    problems: list[str] = field(default_factory=list)


async def post(client: httpx.AsyncClient, job: dict[str, Any]) -> dict[str, Any]:
    resp = await client.post("/v1/jobs", json=job)
    assert resp.status_code == 200, resp.text
    return json.loads(resp.text.strip().splitlines()[-1])["receipt"]


async def timed_turn(client: httpx.AsyncClient, chat: Chat, msg: str) -> tuple[dict[str, Any], float]:
    chat.expect_turn(msg)
    t = time.perf_counter()
    receipt = await post(client, chat.job(msg))
    return receipt, (time.perf_counter() - t) * 1000


async def wait_committed(client: httpx.AsyncClient, chat: Chat, job: dict[str, Any]) -> dict[str, Any]:
    """Poll until the job's receipt exists (only 202 meanwhile)."""
    with anyio.fail_after(180):
        while (resp := await client.get(f"/v1/jobs/{job['job_id']}", params={"user_id": chat.user_id})
               ).status_code == 202:
            await anyio.sleep(0.1)
    assert resp.status_code == 200, resp.text
    return resp.json()


async def _check_held(client: httpx.AsyncClient, held: list[tuple[Chat, dict[str, Any]]], label: str,
                      report: RestartReport) -> None:
    for c, job in held:
        got = await wait_committed(client, c, job)
        if (got["outcome"], got["context_status"], got["assistant_text"]) != ("succeeded", "LIVE", c.history[-1].text):
            report.problems.append(f"{label} {c.chat_id}: {got['outcome']} {got['context_status']} {got['reason']}")
            continue
        again = await post(client, job)  # a re-dispatch returns the one receipt
        if again != got:
            report.problems.append(f"{label} {c.chat_id}: the re-dispatch answered another receipt")
            continue
        report.committed_once += 1


async def run_restart_rounds(fx: LoopbackFixture, home: Path, image: str, runtime: str, n_chats: int,
                             restarts: int, *, hold_s: float = 3.0, timings: bool = False) -> RestartReport:
    """``timings``: also time a LIVE and a RESTORED turn per chat before the rounds (the bench)."""
    report = RestartReport()
    chats = [Chat(runtime) for _ in range(n_chats)]
    held: list[tuple[Chat, dict[str, Any]]] = []
    with daemon_process(home, fx.base_url, image) as dp:
        async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=300) as client:
            async with anyio.create_task_group() as tg:
                for c in chats:
                    tg.start_soon(timed_turn, client, c, "hello")
            for c in chats if timings else []:
                r, ms = await timed_turn(client, c, "a live one")
                assert r["context_status"] == "LIVE", r
                report.live_ms.append(ms)
                await client.post(f"/v1/users/{c.user_id}/chats/{c.chat_id}/members/{c.member_id}/retire")
                r, ms = await timed_turn(client, c, "a restored one")
                assert r["context_status"] == "RESTORED", r
                report.restored_ms.append(ms)
    for rnd in range(restarts):
        t_spawn = time.perf_counter()
        with daemon_process(home, fx.base_url, image) as dp:
            report.ready_ms.append((time.perf_counter() - t_spawn) * 1000)
            async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=300) as client:
                await _check_held(client, held, f"round {rnd}", report)
                for i, c in enumerate(chats):
                    r, _ = await timed_turn(client, c, f"after restart {rnd}")
                    if i == 0:
                        report.first_live_ms.append((time.perf_counter() - t_spawn) * 1000)
                    if r["context_status"] != "LIVE":
                        report.problems.append(f"round {rnd} {c.chat_id}: {r['context_status']} {r['reason']}")
                held = []
                mark = fx.requests()[-1].seq if fx.requests() else 0
                for c in chats:
                    msg = f"in flight {rnd} {c.chat_id}"
                    fx.add_rule(stall(hold_s, match=msg, times=1))
                    c.expect_turn(msg)
                    held.append((c, c.job(msg)))

                async def send(job: dict[str, Any]) -> None:
                    try:
                        await client.post("/v1/jobs", json=job)
                    except httpx.HTTPError:
                        pass

                async with anyio.create_task_group() as tg:
                    for _, job in held:
                        tg.start_soon(send, job)
                    # every reply is streaming: its head and first event are out, the rest held
                    await anyio.to_thread.run_sync(lambda: fx.wait_for(
                        lambda rs: sum(r.seq > mark and r.kind == "conversation" for r in rs) >= n_chats, timeout=120))
                    await anyio.sleep(0.3)
                    dp.kill9()
                    tg.cancel_scope.cancel()
                report.held += len(held)
    with daemon_process(home, fx.base_url, image) as dp:
        async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=300) as client:
            await _check_held(client, held, "last round", report)
            for c in chats:
                mark = fx.requests()[-1].seq
                r, _ = await timed_turn(client, c, "the last one")
                users = [m.text for m in fx.requests(kind="conversation", since=mark)[-1].conversation()
                         if m.role == "user"]
                if r["context_status"] != "LIVE":
                    report.problems.append(f"{c.chat_id}: the last turn was {r['context_status']}")
                if users != c.user_texts():
                    report.problems.append(f"{c.chat_id}: the model saw {users}, not {c.user_texts()}")
    for c in chats:
        for msg in (t for t in c.user_texts() if t.startswith("in flight")):
            carried = [r.seq for r in fx.requests(kind="conversation")
                       if [m.text for m in r.conversation() if m.role == "user"][-1:] == [msg]]
            if len(carried) != 1:
                report.problems.append(f"{c.chat_id}: {msg!r} reached the model in {len(carried)} requests")
    return report
