"""Soak: the daemon's RSS and open file descriptors stay flat over thousands of turns.

    uv run python tests/bench/soak.py [--minutes 10] [--chats 6] [--warmup-frac 0.2]

The daemon runs as its own process (`cloud-agent serve`) against an out-of-process loopback
fixture, so only the daemon is measured. Codex (the fastest CLI) chats run turns back to
back; every 25th turn of a chat first retires its member (a RESTORED turn: launch, resume,
retire paths too). Every 5 s the daemon's VmRSS and open fds are sampled; after the warm-up
fraction of the run, max/min of each must stay within 10%.
"""

from __future__ import annotations

import argparse
import os
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
    samples: list[tuple[float, int, int]] = []
    counts = {"turns": 0, "failed": 0, "restored": 0}
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

                async def sampler() -> None:
                    while True:
                        rss, fds = rss_and_fds(pid)
                        samples.append((time.monotonic() - t0, rss, fds))
                        await anyio.sleep(5)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(sampler)
                    async with anyio.create_task_group() as chats:
                        for i in range(args.chats):
                            chats.start_soon(chat_loop, i)
                    tg.cancel_scope.cancel()
            wall = time.monotonic() - t0
            client_docker = docker.from_env()
            for row in client_docker.api.containers(all=True, filters={"label": f"org.cloud-agent.host-id={host_id}"}):
                client_docker.api.remove_container(row["Id"], force=True)
    finally:
        fixture.terminate()
    warm = [s for s in samples if s[0] >= args.warmup_frac * wall]
    rss = [s[1] for s in warm]
    fds = [s[2] for s in warm]
    mib = 1024 * 1024
    print(f"{counts['turns']} turns in {wall:.0f} s ({counts['turns'] / wall:.1f} turns/s), "
          f"{counts['restored']} RESTORED, {counts['failed']} failed {failures[:3]}")
    print(f"daemon RSS after warm-up ({len(warm)} samples): min {min(rss) / mib:.1f} MiB, "
          f"max {max(rss) / mib:.1f} MiB, growth {100 * (max(rss) / min(rss) - 1):.1f}% "
          f"(first {samples[0][1] / mib:.1f}, last {samples[-1][1] / mib:.1f})")
    print(f"daemon open fds after warm-up: min {min(fds)}, max {max(fds)}, growth {100 * (max(fds) / min(fds) - 1):.1f}%"
          f" (first {samples[0][2]}, last {samples[-1][2]})")
    flat = max(rss) <= 1.1 * min(rss) and max(fds) <= 1.1 * min(fds)
    print("flat within 10% after warm-up" if flat else "NOT flat within 10%")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--chats", type=int, default=6)
    p.add_argument("--warmup-frac", type=float, default=0.2)
    anyio.run(main, p.parse_args())
