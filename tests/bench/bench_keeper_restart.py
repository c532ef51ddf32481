"""Daemon restarts under keepers (SPEC 14), through the HTTP API of a daemon subprocess.

    uv run python tests/bench/bench_keeper_restart.py [RUNTIME] [CHATS] [RESTARTS]

Defaults: codex, 4 chats, 3 restarts. Each round: every chat has a turn in flight (the
fixture holds each reply mid-stream), the daemon is killed with ``kill -9``, a new one starts;
every held turn must be committed exactly once by the new daemon (polled through
``GET /v1/jobs``) and the next turn of each chat must be ``LIVE``. At the end each chat's
last request must carry every user message exactly once. Printed side by side in one run:
a LIVE turn, a RESTORED turn (after a retire: what every turn after a restart cost before
keepers), and the time from the daemon's start to its first re-adopted LIVE turn.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from deploy.loopback import LoopbackFixture, stall
from images.build import ensure_image
from tests.daemon_harness import TOKEN, daemon_process
from tests.supervisor_helpers import Chat

HEADERS = {"authorization": f"Bearer {TOKEN}"}


async def post(client: httpx.AsyncClient, job: dict) -> dict:
    resp = await client.post("/v1/jobs", json=job)
    return json.loads(resp.text.strip().splitlines()[-1])["receipt"]


async def timed_turn(client: httpx.AsyncClient, chat: Chat, msg: str) -> tuple[dict, float]:
    chat.expect_turn(msg)
    t = time.perf_counter()
    receipt = await post(client, chat.job(msg))
    return receipt, (time.perf_counter() - t) * 1000


async def wait_committed(client: httpx.AsyncClient, chat: Chat, job: dict) -> dict:
    with anyio.fail_after(180):
        while (resp := await client.get(f"/v1/jobs/{job['job_id']}", params={"user_id": chat.user_id})
               ).status_code == 202:
            await anyio.sleep(0.1)
    return resp.json()


def med(xs: list[float]) -> str:
    return f"p50 {statistics.median(xs):8.1f} ms  (n={len(xs)}, min {min(xs):.1f}, max {max(xs):.1f})"


async def main(runtime: str, n_chats: int, restarts: int) -> None:
    image = ensure_image()
    home = Path(tempfile.mkdtemp(prefix="bench-keeper-restart-")) / "home"
    chats = [Chat(runtime) for _ in range(n_chats)]
    live, restored, first_live, ready, problems = [], [], [], [], []
    with LoopbackFixture.start() as fx:
        with daemon_process(home, fx.base_url, image) as dp:
            async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=300) as client:
                async with anyio.create_task_group() as tg:
                    for c in chats:
                        tg.start_soon(timed_turn, client, c, "hello")
                for c in chats:
                    r, ms = await timed_turn(client, c, "a live one")
                    assert r["context_status"] == "LIVE", r
                    live.append(ms)
                    await client.post(f"/v1/users/{c.user_id}/chats/{c.chat_id}/members/{c.member_id}/retire")
                    r, ms = await timed_turn(client, c, "a restored one")
                    assert r["context_status"] == "RESTORED", r
                    restored.append(ms)
        for rnd in range(restarts):
            t_spawn = time.perf_counter()
            with daemon_process(home, fx.base_url, image) as dp:
                up = (time.perf_counter() - t_spawn) * 1000
                async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=300) as client:
                    if rnd:  # the held turns of the previous round: committed once, by this daemon
                        for c, job in held:
                            got = await wait_committed(client, c, job)
                            if got["outcome"] != "succeeded" or got["assistant_text"] != c.history[-1].text:
                                problems.append(f"round {rnd} {c.chat_id}: {got['outcome']} {got['reason']}")
                    r, ms = await timed_turn(client, chats[0], f"first after restart {rnd}")
                    first_live.append((time.perf_counter() - t_spawn) * 1000)
                    ready.append(up)
                    if r["context_status"] != "LIVE":
                        problems.append(f"round {rnd}: first turn {r['context_status']}")
                    for c in chats[1:]:
                        r, _ = await timed_turn(client, c, f"after restart {rnd}")
                        if r["context_status"] != "LIVE":
                            problems.append(f"round {rnd} {c.chat_id}: {r['context_status']}")
                    held = []
                    mark = len(fx.requests())
                    for c in chats:
                        msg = f"in flight {rnd} {c.chat_id}"
                        fx.add_rule(stall(30, match=msg, times=1))
                        c.expect_turn(msg)
                        held.append((c, c.job(msg)))

                    async def send(job: dict) -> None:
                        try:
                            await client.post("/v1/jobs", json=job)
                        except httpx.HTTPError:
                            pass

                    async with anyio.create_task_group() as tg:
                        for _, job in held:
                            tg.start_soon(send, job)
                        await anyio.to_thread.run_sync(lambda: fx.wait_for(
                            lambda rs: len(rs) >= mark + n_chats, timeout=120))
                        await anyio.sleep(0.5)
                        dp.kill9()
                        tg.cancel_scope.cancel()
            fx.set_rules([])
        with daemon_process(home, fx.base_url, image) as dp:
            async with httpx.AsyncClient(base_url=dp.url, headers=HEADERS, timeout=300) as client:
                for c, job in held:
                    got = await wait_committed(client, c, job)
                    if got["outcome"] != "succeeded":
                        problems.append(f"last round {c.chat_id}: {got['outcome']} {got['reason']}")
                for c in chats:
                    r, _ = await timed_turn(client, c, "the last one")
                    users = [m.text for m in fx.requests(kind="conversation")[-1].conversation() if m.role == "user"]
                    if r["context_status"] != "LIVE" or sorted(set(users)) != sorted(users):
                        problems.append(f"{c.chat_id}: {r['context_status']}, users {users}")
                    if users != c.user_texts():
                        problems.append(f"{c.chat_id}: history {users} != {c.user_texts()}")
    print(f"{runtime}: {n_chats} chats, {restarts} kill -9 restarts, each with {n_chats} turns in flight")
    print(f"LIVE turn                           {med(live)}")
    print(f"RESTORED turn (after a retire)      {med(restored)}   ratio {statistics.median(restored) / statistics.median(live):.1f}x")
    print(f"daemon start to /healthz            {med(ready)}")
    print(f"daemon start to first LIVE receipt  {med(first_live)}  (re-adopted keeper; rounds with turns in flight)")
    print(f"turns in flight committed once: {n_chats * restarts - sum('round' in p or 'last' in p for p in problems)}"
          f" of {n_chats * restarts}")
    print("problems:", problems or "none")


if __name__ == "__main__":
    args = sys.argv[1:]
    anyio.run(main, args[0] if args else "codex", int(args[1]) if len(args) > 1 else 4,
              int(args[2]) if len(args) > 2 else 3)
