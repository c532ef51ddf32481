"""Load: 48 chats across the five CLIs, three turns each, a resident memory budget with room
for about eight residents, on this machine (SPEC section 13; issue 13).

    uv run python tests/bench/load.py [--chats 48] [--turns 3] [--budget-mb 3200] [--max-turns N] [--queue-timeout-s 1800]

Prints the peak resident memory sampled independently from the host (every CLI process in
every sandbox of the run) against the budget, turns/s, p50/p99 latency per context status,
LIVE->RESTORED transitions the budget caused (retirements by cause), failed turns and the
turns whose request did not carry exactly the chat's history in the fixture's audit.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import anyio
import docker

from deploy.loopback import LoopbackFixture
from images.build import ensure_image
from tests.daemon_harness import daemon_settings, running_daemon
from tests.regression.conftest import remove_host_containers
from tests.support.load import MiB, MemorySampler, chats_for, run_load


async def main(args: argparse.Namespace) -> None:
    image = ensure_image()
    with LoopbackFixture.start() as fx, tempfile.TemporaryDirectory() as tmp:
        overrides = {"resident_memory_mb": args.budget_mb, "memory_refresh_s": 0.5,
                     "handshake_timeout_s": 240.0,
                     # the load run measures the budget, not host_busy (tests/cli/test_capacity_admission.py
                     # does): a queued turn waits for its slot instead of being answered 503 at 30 s
                     "queue_timeout_s": args.queue_timeout_s}
        if args.max_turns:
            overrides["max_turns"] = args.max_turns
        settings = daemon_settings(Path(tmp) / "home", fx.base_url, image, **overrides)
        try:
            async with running_daemon(settings, proxy_process=True) as d:
                sampler = MemorySampler(settings.resolved_host_id())
                result = await run_load(d, fx, chats_for(args.chats), args.turns, sampler)
        finally:
            remove_host_containers(docker.from_env(), settings.resolved_host_id())  # and their state volumes
    n = len(result.turns)
    print(f"chats {args.chats} x turns {args.turns} = {n} turns, budget {args.budget_mb} MiB, "
          f"max_turns {settings.max_turns}")
    print(f"peak resident memory (sampled {result.samples}x from the host): {result.peak_bytes / MiB:.0f} MiB "
          f"= {100 * result.peak_bytes / (args.budget_mb * MiB):.0f}% of the budget"
          f" -> {'never over' if result.peak_bytes <= args.budget_mb * MiB else 'OVER'}")
    at_peak: dict[str, list[int]] = {}
    for _, name, rss in sampler.peak_processes:
        at_peak.setdefault(name, []).append(rss)
    print(f"  at the peak, {len({c for c, _, _ in sampler.peak_processes})} sandboxes: " + ", ".join(
        f"{name} x{len(v)} {sum(v) / MiB:.0f} MiB" for name, v in sorted(at_peak.items(), key=lambda kv: -sum(kv[1]))))
    print(f"wall {result.wall_s:.1f} s, {n / result.wall_s:.2f} turns/s")
    for status, (count, p50, p99) in result.latency_by_status().items():
        print(f"  {status:<9} n={count:<4} p50 {p50:8.0f} ms   p99 {p99:8.0f} ms")
    print(f"budget retirements (each a LIVE->RESTORED next turn): {result.budget_retirements}")
    print(f"failed turns: {len(result.failed)} {[(t.runtime, t.outcome) for t in result.failed][:10]}")
    print(f"history not exact: {len(result.history_mismatches)} "
          f"{[(t.runtime, t.detail[:120]) for t in result.history_mismatches][:5]}")


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--chats", type=int, default=48)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--budget-mb", type=int, default=3200)
    p.add_argument("--max-turns", type=int, default=0)
    p.add_argument("--queue-timeout-s", type=float, default=1800.0)
    anyio.run(main, p.parse_args())
