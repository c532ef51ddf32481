"""Fleet costs, measured side by side in one run (SPEC 16).

    uv run python tests/bench/bench_fleet.py [CHATS] [TURNS]

1. Store overhead per turn: the job fence's claim + the atomic commit (receipt + member
   locator), SQLite (WAL, synchronous=FULL) against PostgreSQL (a throwaway cluster with
   fsync on), sequential and with 8 concurrent chats.
2. Three hosts against one (same machine, same PostgreSQL store, Codex against the loopback
   fixture): CHATS chats x TURNS turns, every job sent to a host round-robin (so two thirds
   of the three-host jobs are forwarded): turns/s and p50/p95 turn latency.

This machine has 2 cores: three hosts on it measure the fleet's overhead (placement,
forwarding, the shared store), not its scale.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

from deploy.loopback import LoopbackFixture
from images.build import ensure_image
from state.contract import MemberOutcome, StoreContract, VerifiedTurn
from state.postgres import PostgresStore
from state.records import SavedLocator
from state.store import Store
from tests.supervisor_helpers import Chat
from tests.support.fleet import engines, fleet_hosts, ndjson
from tests.support.postgres import pg_cluster


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(p * len(s)))]


async def store_turns(store: StoreContract, n: int, concurrency: int, tag: str) -> float:
    """ms per claim+commit."""
    await store.open()
    for c in range(concurrency):
        await store.ensure_member("u", f"{tag}{c}", "m", "codex")

    async def chat(c: int) -> None:
        for i in range(n // concurrency):
            await store.claim_job(f"{tag}-{c}-{i}", "u", f"{tag}{c}", "m", "digest", "owner")
            await store.finish_job("u", f"{tag}-{c}-{i}", '{"receipt": true}',
                                   MemberOutcome("LIVE", "succeeded", VerifiedTurn(SavedLocator(id=f"L{i}"))))

    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for c in range(concurrency):
            tg.start_soon(chat, c)
    return (time.perf_counter() - t) * 1000 / (n // concurrency * concurrency)


async def bench_store(pg_url: str, tmp: Path, n: int = 400) -> None:
    print("\n1. store overhead per turn (claim + commit)")
    for conc in (1, 8):
        sqlite = Store(tmp / f"bench-{conc}.db")
        pg = PostgresStore(pg_url)
        s_ms = await store_turns(sqlite, n, conc, f"s{conc}")
        p_ms = await store_turns(pg, n, conc, f"p{conc}")
        await pg.aclose()
        sqlite.close()
        print(f"   {conc} chat(s): sqlite {s_ms:6.2f} ms/turn   postgres {p_ms:6.2f} ms/turn   "
              f"postgres/sqlite {p_ms / s_ms:5.2f}x   (+{p_ms - s_ms:.2f} ms per turn)")


async def drive(hosts: list, chats: int, turns: int) -> tuple[float, list[float], int]:
    """(turns/s, latencies ms, failures): chats concurrently, each chat's turns in order."""
    latencies: list[float] = []
    failures = 0

    async def chat_run(chat: Chat, offset: int) -> None:
        nonlocal failures
        for t in range(turns):
            host = hosts[(offset + t) % len(hosts)]
            async with host.client() as client:
                t0 = time.perf_counter()
                resp = await client.post("/v1/jobs", json=chat.job(f"bench turn {t}"))
                events = ndjson(resp.text)
                latencies.append((time.perf_counter() - t0) * 1000)
            receipt = next((e["receipt"] for e in events if e.get("type") == "receipt"), None)
            if receipt is None or receipt["outcome"] != "succeeded":
                failures += 1

    t0 = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(chats):
            tg.start_soon(chat_run, Chat("codex"), i)
    wall = time.perf_counter() - t0
    return chats * turns / wall, latencies, failures


async def bench_hosts(pg, fx: LoopbackFixture, image: str, engs: list, root: Path, chats: int, turns: int) -> None:
    print(f"\n2. three hosts against one ({chats} chats x {turns} turns, Codex, 2-core machine: overhead, not scale)")
    results = {}
    for label, n in (("1 host ", 1), ("3 hosts", 3)):
        url = await anyio.to_thread.run_sync(pg.create_database, "bench")
        with fleet_hosts(engs[:n], store_url=url, gateway_url=fx.base_url, image=image, root=root / label.strip().replace(" ", "-"),
                         lease_ttl_s=30) as hosts:
            await drive(hosts, 1, 1)  # warm-up: image layers, CLI caches
            rate, lat, fails = await drive(hosts, chats, turns)
        results[label] = (rate, statistics.median(lat))
        print(f"   {label}: {rate:5.2f} turns/s   p50 {statistics.median(lat):7.0f} ms   p95 {pct(lat, 0.95):7.0f} ms"
              f"   failures {fails}")
        for h in engs[:n]:
            h.remove_all_containers()
    (r1, p1), (r3, p3) = results["1 host "], results["3 hosts"]
    print(f"   3 hosts / 1 host: throughput {r3 / r1:4.2f}x   p50 {p3 / p1:4.2f}x")


def main() -> None:
    chats = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    turns = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    image = ensure_image()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp, pg_cluster(fsync=True) as pg:
        anyio.run(bench_store, pg.create_database("store"), Path(tmp))
        with LoopbackFixture.start() as fx, engines(3, image) as engs:
            anyio.run(bench_hosts, pg, fx, image, engs, Path(tmp), chats, turns)


if __name__ == "__main__":
    main()
