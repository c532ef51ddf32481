"""Soak: the daemon's and its model proxy service's RSS and open file descriptors stay flat
over thousands of turns.

    uv run python tests/bench/soak.py [--minutes 10] [--chats 6] [--warmup-frac 0.2]

The daemon runs as its own process (`cloud-agent serve`) against an out-of-process loopback
fixture, so only the daemon and its proxy service (a process of their own since issue 12) are
measured. Codex (the fastest CLI) chats run turns back to back; every 25th turn of a chat first
retires its member (a RESTORED turn: launch, resume, retire paths too); after ``--turns-per-chat``
turns the chat is deleted and another begins (deletion paths too). One chat per loop all run long
(``--turns-per-chat 0``) measures something else: each request carries the whole history, so
the proxy's and the daemon's working set per turn grows with it (a 20-minute run: ~1400-turn
chats, the service's RSS 42 -> 113 MiB, turns/min 667 -> 290; with 100-turn chats the service
stayed at 47 MiB and the rate at ~660 turns/min).

Every 5 s both processes' VmRSS and open fds are sampled and a per-minute series is printed. After the warm-up
fraction of the run: RSS max/min within 10%, and no trend — the last quarter's median within
10% of the first warm quarter's (fds: the trend only, within 10% or ``--chats``; a single
sample's count swings with the streams the turns in flight hold, and is printed).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import docker
import httpx

from images.build import ensure_image
from tests.daemon_harness import TOKEN, daemon_process
from tests.regression.conftest import remove_host_containers
from tests.supervisor_helpers import Chat


def rss_and_fds(pid: int) -> tuple[int, int]:
    rss = 0
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
    return rss, len(os.listdir(f"/proc/{pid}/fd"))


def start_fixture() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen([sys.executable, "-m", "deploy.loopback", "--port", "0"], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    return proc, line.strip().rsplit(" ", 1)[1]


async def main(args: argparse.Namespace) -> None:
    image = ensure_image()
    fixture, url = start_fixture()
    samples: list[tuple[float, int, int]] = []  # (s since start, RSS bytes, open fds): the daemon
    service: list[tuple[float, int, int]] = []  # the same for its model proxy service
    turns_at: list[int] = []  # turns done at each sample
    counts = {"turns": 0, "failed": 0, "restored": 0, "chats_deleted": 0}
    failures: list[str] = []
    try:
        with tempfile.TemporaryDirectory() as tmp, daemon_process(Path(tmp) / "home", url, image) as dp:
            pid = dp.proc.pid
            host_id = next(line.split("=", 1)[1] for line in open(f"/proc/{pid}/environ").read().split("\0")
                           if line.startswith("CLOUD_AGENT_HOST_ID="))
            deadline = time.monotonic() + args.minutes * 60
            t0 = time.monotonic()
            async with httpx.AsyncClient(base_url=dp.url, headers={"authorization": f"Bearer {TOKEN}"},
                                         timeout=httpx.Timeout(300, connect=10)) as client:

                async def chat_loop(i: int) -> None:
                    chat = Chat("codex")
                    n = 0
                    while time.monotonic() < deadline:
                        n += 1
                        if args.turns_per_chat and n > args.turns_per_chat:
                            # a host's chats end: delete this one (sandbox, volume, socket) and begin
                            # another, so what a request carries stays the same size all run long
                            resp = await client.delete(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}")
                            assert resp.status_code == 200, resp.text
                            counts["chats_deleted"] += 1
                            chat, n = Chat("codex"), 1
                        if n % 25 == 0:
                            await client.post(f"/v1/users/{chat.user_id}/chats/{chat.chat_id}/members/m1/retire")
                        resp = await client.post("/v1/jobs", json=chat.job(f"soak {i} turn {n}"))
                        last = resp.text.strip().rsplit("\n", 1)[-1]
                        counts["turns"] += 1
                        if '"outcome": "succeeded"' not in last:
                            counts["failed"] += 1
                            failures.append(last[:200])
                        elif '"context_status": "RESTORED"' in last:
                            counts["restored"] += 1

                service_pid = int((Path(tmp) / "home" / "proxy" / "service.pid").read_text())

                async def sampler() -> None:
                    while True:
                        at = time.monotonic() - t0
                        samples.append((at, *rss_and_fds(pid)))
                        service.append((at, *rss_and_fds(service_pid)))
                        turns_at.append(counts["turns"])
                        await anyio.sleep(5)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(sampler)
                    async with anyio.create_task_group() as chats:
                        for i in range(args.chats):
                            chats.start_soon(chat_loop, i)
                    tg.cancel_scope.cancel()
            wall = time.monotonic() - t0
            remove_host_containers(docker.from_env(), host_id)  # and their state volumes
    finally:
        fixture.terminate()
    print(f"{counts['turns']} turns in {wall:.0f} s ({counts['turns'] / wall:.1f} turns/s), "
          f"{counts['restored']} RESTORED, {counts['chats_deleted']} chats deleted and begun again, "
          f"{counts['failed']} failed {failures[:3]}")
    mib = 1024 * 1024
    print(f"{'min':>4} {'turns':>6} {'daemon RSS':>11} {'fds':>4} {'service RSS':>12} {'fds':>4}")
    for i in range(0, len(samples), 12):  # a row a minute
        (at, rss, fds), (_, s_rss, s_fds) = samples[i], service[i]
        print(f"{at / 60:4.0f} {turns_at[i]:6d} {rss / mib:9.1f}Mi {fds:4d} {s_rss / mib:10.1f}Mi {s_fds:4d}")
    flat = all([report("daemon", samples, wall, args), report("proxy service", service, wall, args)])
    print("flat after warm-up" if flat else "NOT flat after warm-up")


def report(name: str, samples: list[tuple[float, int, int]], wall: float, args: argparse.Namespace) -> bool:
    warm = [s for s in samples if s[0] >= args.warmup_frac * wall]
    quarter = max(1, len(warm) // 4)
    mib = 1024 * 1024
    ok = True
    for label, col, unit, slack in (("RSS", 1, mib, 0), ("open fds", 2, 1, args.chats)):
        xs = [s[col] for s in warm]
        first, last = statistics.median(xs[:quarter]), statistics.median(xs[-quarter:])
        # a sample of open fds catches whatever streams the turns in flight hold at that moment
        # (the API stream, an exec being replaced): for fds only the trend tells a leak
        spread = max(xs) <= 1.1 * min(xs) or col == 2
        trend = last <= 1.1 * first or last - first <= slack
        ok = ok and spread and trend
        print(f"{name} {label} after warm-up ({len(xs)} samples): min {min(xs) / unit:.1f}, max {max(xs) / unit:.1f}"
              f" ({'ok' if spread else 'over'}); median first warm quarter {first / unit:.1f} -> last quarter "
              f"{last / unit:.1f} ({'ok' if trend else 'growing'})")
    return ok

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--warmup-frac", type=float, default=0.2)
    p.add_argument("--turns-per-chat", type=int, default=100,
                   help="then the chat is deleted and another begins (0: one chat each all run long; every "
                        "request then carries the whole, growing history and its cost grows with it)")
    anyio.run(main, p.parse_args())
