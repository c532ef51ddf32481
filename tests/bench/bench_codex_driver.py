"""Codex driver benchmarks (a script, not a test).

    uv run python tests/bench/bench_codex_driver.py [--rounds N] [--real TURNS]

1. Parser throughput over the recorded real streams (tests/data/codex/): JSON decode +
   classification + TurnTracker, in wire messages per second and MB/s, next to the bare
   ``json.loads`` floor.
2. Settlement latency on replay: time from the moment the transport hands the driver the
   CLI's last event (``turn/completed``) to ``run_turn`` returning the Settlement.
3. ``--real TURNS``: the same latency with the real codex 0.171.0 in the pinned image against
   the loopback fixture (needs Docker), plus the whole turn time for scale.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import structlog

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from drivers.base import parse_json_line  # noqa: E402
from drivers.codex import CodexDriver, CodexSettings  # noqa: E402
from drivers.codex.wire import TurnTracker, kind_of  # noqa: E402
from drivers.models import GatewayConfig, MemberPaths, Settlement  # noqa: E402
from tests.support.codex_replay import ReplayTransport  # noqa: E402
from tests.support.replay import Entry, load_stream  # noqa: E402

DATA = ROOT / "tests" / "data" / "codex"
PATHS = MemberPaths(home="/home/agent/m", workspace="/home/agent/workspace", run_dir="/home/agent/run")
GW = GatewayConfig(base_url="http://127.0.0.1:9", key="k", model="fixture-model")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def fmt_us(values: list[float]) -> str:
    return (f"p50 {statistics.median(values) * 1e6:8.1f} µs   p95 {pct(values, 0.95) * 1e6:8.1f} µs   "
            f"max {max(values) * 1e6:8.1f} µs   (n={len(values)})")


# ---------------------------------------------------------------- 1. parser throughput


def parser_throughput(rounds: int) -> None:
    streams: list[list[bytes]] = []
    trackers: list[tuple[str, str]] = []
    for path in sorted(DATA.glob("*.jsonl")):
        entries = load_stream(path)
        recv = [line for d, line in entries if d == "recv"]
        objs = [parse_json_line(line) or {} for line in recv]
        thread = next((o["result"]["thread"]["id"] for o in objs
                       if o.get("id") == 1 and isinstance(o.get("result"), dict) and "thread" in o["result"]), "t")
        turn = next((o["result"]["turn"]["id"] for o in objs
                     if isinstance(o.get("result"), dict) and "turn" in o["result"]), "u")
        streams.append(recv)
        trackers.append((thread, turn))
    n_msgs = sum(len(s) for s in streams)
    n_bytes = sum(len(line) + 1 for s in streams for line in s)

    t0 = time.perf_counter()
    for _ in range(rounds):
        for recv in streams:
            for line in recv:
                json.loads(line)
    floor = time.perf_counter() - t0

    events = 0
    t0 = time.perf_counter()
    for _ in range(rounds):
        for recv, (thread, turn) in zip(streams, trackers):
            tracker = TurnTracker(thread, turn)
            for line in recv:
                obj = parse_json_line(line)
                if obj is not None:
                    kind_of(obj)
                    events += len(tracker.feed(obj))
    full = time.perf_counter() - t0
    total = n_msgs * rounds
    print(f"recorded streams: {len(streams)} files, {n_msgs} wire messages, {n_bytes / 1024:.1f} KiB; {rounds} rounds")
    print(f"  json.loads only          {total / floor:12,.0f} msg/s   {n_bytes * rounds / floor / 1e6:7.1f} MB/s")
    print(f"  parse+classify+tracker   {total / full:12,.0f} msg/s   {n_bytes * rounds / full / 1e6:7.1f} MB/s   "
          f"({events * 1.0 / full:,.0f} normalized events/s)")


# ---------------------------------------------------------------- 2. replay settlement latency


class TimedReplay(ReplayTransport):
    """Notes when the settling ``turn/completed`` line is handed to the driver."""

    last_event_at: float | None = None

    async def receive(self) -> bytes | None:
        line = await super().receive()
        if line is not None and b'"turn/completed"' in line:
            self.last_event_at = time.perf_counter()
        return line


async def replay_latency(rounds: int) -> None:
    driver = CodexDriver(CodexSettings())
    names = ["success", "failed_400", "tool_call", "retry_then_success", "server_request"]
    recordings: dict[str, list[Entry]] = {n: load_stream(DATA / f"{n}.jsonl") for n in names}
    lat: list[float] = []
    per_turn: list[float] = []
    for _ in range(rounds):
        for entries in recordings.values():
            t = TimedReplay(entries)
            s = driver.session(t, driver.plan(PATHS, GW, None))
            await s.handshake()
            t0 = time.perf_counter()
            r = await s.run_turn("hello codex", timeout_s=5)
            done = time.perf_counter()
            assert isinstance(r, Settlement) and t.last_event_at is not None, r
            lat.append(done - t.last_event_at)
            per_turn.append(done - t0)
    print("replay: last CLI event -> Settlement returned   " + fmt_us(lat))
    print("replay: whole run_turn (driver CPU only)         " + fmt_us(per_turn))


# ---------------------------------------------------------------- 3. the real CLI


async def real_latency(turns: int) -> None:
    import docker

    from deploy.engine import EngineConfig
    from images.build import ensure_image
    from tests.cli.test_codex_driver import Box

    client = docker.DockerClient(base_url=f"unix://{EngineConfig.from_env().socket_path}")
    import shutil
    import tempfile
    root = Path(tempfile.mkdtemp(prefix="ca-codex-bench-", dir="/var/tmp"))
    root.chmod(0o755)
    from tests.support.sealed import MODELGATE_COMMAND, sealed_fixture, sealed_volumes

    c = client.containers.run(ensure_image(), MODELGATE_COMMAND, detach=True, init=True, network_mode="none",
                              user="agent", volumes={str(root): {"bind": str(root), "mode": "rw"},
                                                     **sealed_volumes(root / ".model")})
    try:
        async with sealed_fixture(root / ".model", Box.key) as (fx, gate):
            box = Box(c, root / "bench", fx, "bench")
            box.gateway = gate.gateway(model=box.model)
            box.root.mkdir()
            log: list[Entry] = []
            t_start = time.perf_counter()
            s = await box.start(box.member("m"), log=log)
            await s.handshake()
            startup = time.perf_counter() - t_start
            lat: list[float] = []
            whole: list[float] = []
            for i in range(turns):
                seen: dict[str, float] = {}
                inner_receive = s.transport.receive

                async def receive(_inner: Any = inner_receive, _seen: dict[str, float] = seen) -> bytes | None:
                    line = await _inner()
                    if line is not None and b'"turn/completed"' in line:
                        _seen["at"] = time.perf_counter()
                    return line
                s.transport.receive = receive  # type: ignore[method-assign]
                t0 = time.perf_counter()
                r = await s.run_turn(f"bench turn {i}", timeout_s=60)
                done = time.perf_counter()
                assert isinstance(r, Settlement) and not r.is_error, r
                lat.append(done - seen["at"])
                whole.append(done - t0)
            await box.shutdown()
        print(f"real codex 0.171.0 in the image: process start + handshake {startup * 1000:.0f} ms")
        print("real: last CLI event -> Settlement returned      " + fmt_us(lat))
        print(f"real: whole turn (CLI + fixture)                 p50 {statistics.median(whole) * 1000:8.1f} ms   "
              f"p95 {pct(whole, 0.95) * 1000:8.1f} ms   (n={len(whole)})")
    finally:
        c.remove(force=True)
        client.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    # the replayed server_request stream logs a refusal per round; keep the figures readable
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--real", type=int, default=0, metavar="TURNS", help="also measure the real CLI (needs Docker)")
    args = ap.parse_args()
    parser_throughput(args.rounds)
    anyio.run(replay_latency, max(1, args.rounds // 4))
    if args.real:
        anyio.run(real_latency, args.real)


if __name__ == "__main__":
    main()
