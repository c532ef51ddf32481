"""Pi driver benchmarks (a script, not a test).

    uv run python tests/bench/bench_pi_driver.py [--turns 30] [--docker]

1. Settlement latency with the real pi 0.73.1 and the loopback fixture: time from the last
   line pi printed for the turn before the barrier (``agent_end``) to the Settlement returned
   by ``run_turn`` — i.e. the cost of the ``get_state`` barrier — side by side with an idle
   ``get_state`` round trip on the same process. Host pi by default (``PI_BIN_DIR`` or the
   brief's build dir); ``--docker`` runs it inside the pinned image through ``docker exec``.
2. Parser throughput over the recorded streams (tests/data/pi/): the sans-IO tracker alone
   (JSON decode + ``PiTurn.feed``) and the whole session over the scripted transport.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from drivers.base import parse_json_line  # noqa: E402
from drivers.models import GatewayConfig, MemberPaths, Settlement  # noqa: E402
from drivers.pi import PiDriver, PiSession, PiSettings  # noqa: E402
from drivers.pi.wire import PiTurn  # noqa: E402
from drivers.transport import TransportWrapper  # noqa: E402
from tests.support.local_process import LocalProcessTransport  # noqa: E402
from tests.support.pi_replay import ScriptedPiTransport  # noqa: E402
from tests.support.replay import load_stream  # noqa: E402

DATA = ROOT / "tests" / "data" / "pi"
BUILD = "/var/tmp/cloud-agent-build/ctx-8513ace37ce2"


class Stamped(TransportWrapper):
    """Transport wrapper that remembers when each line arrived."""

    def __init__(self, inner: LocalProcessTransport) -> None:
        super().__init__(inner)
        self.log: list[tuple[float, bytes]] = []

    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        if line is not None:
            self.log.append((time.perf_counter(), line))
        return line


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def fmt(xs: list[float]) -> str:
    ms = [x * 1000 for x in xs]
    return f"median {statistics.median(ms):7.2f} ms   p95 {pct(ms, 95):7.2f} ms   max {max(ms):7.2f} ms   (n={len(ms)})"


async def settlement_latency(turns: int, docker: str | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pi-bench-", dir="/var/tmp"))
    tmp.chmod(0o777)
    paths = MemberPaths(home=str(tmp / "home"), workspace=str(tmp / "ws"), run_dir=str(tmp / "run"))
    container = None
    try:
        from tests.support.sealed import MODELGATE_COMMAND, docker_run_args, sealed_fixture

        async with sealed_fixture(tmp / ".model", "sk-bench-key") as (fx, gate):
            if docker:
                container = subprocess.run(
                    ["docker", "run", "-d", "--rm", "--init", *docker_run_args(tmp / ".model"), "--user", "agent",
                     "-v", f"{tmp}:{tmp}", docker, *MODELGATE_COMMAND],
                    check=True, capture_output=True, text=True).stdout.strip()
                driver = PiDriver(PiSettings())
                launch = driver.plan(paths, gate.gateway(model="m"), None)
                launch.spec.materialize_files_locally()
                subprocess.run(["chown", "-R", "1000:1000", str(tmp)], check=True)
                inner = await LocalProcessTransport.start(
                    launch.spec, launcher=("ca-launch",), run_dir=Path(paths.run_dir),
                    exec_prefix=("docker", "exec", "-i", "-u", "agent", container))
            else:
                bindir = os.environ.get("PI_BIN_DIR", f"{BUILD}/runtime/usr/local/bin:{BUILD}/agents/usr/local/bin")
                driver = PiDriver(PiSettings(extra_env={"PATH": f"{bindir}:/usr/bin:/bin"}))
                launch = driver.plan(paths, GatewayConfig(base_url=fx.base_url, key="sk-bench", model="m"), None)
                inner = await LocalProcessTransport.start(launch.spec, run_dir=Path(paths.run_dir))
            t = Stamped(inner)
            session = driver.session(t, launch)
            t0 = time.perf_counter()
            await session.handshake()
            startup = time.perf_counter() - t0
            barrier, idle, total = [], [], []
            for i in range(turns):
                t.log.clear()
                start = time.perf_counter()
                out = await session.run_turn(f"bench turn {i}", timeout_s=60)
                done = time.perf_counter()
                assert isinstance(out, Settlement) and not out.is_error, out
                end_at = max(ts for ts, line in t.log if (parse_json_line(line) or {}).get("type") == "agent_end")
                barrier.append(done - end_at)
                total.append(done - start)
                t1 = time.perf_counter()
                await session._command("get_state")
                idle.append(time.perf_counter() - t1)
            where = f"docker ({docker})" if docker else "host"
            print(f"pi 0.73.1 on {where}, loopback fixture, {turns} turns")
            print(f"  startup → get_state answered      {startup * 1000:7.0f} ms")
            print(f"  agent_end → Settlement returned   {fmt(barrier)}")
            print(f"  idle get_state round trip         {fmt(idle)}")
            print(f"  whole turn (prompt → Settlement)  {fmt(total)}")
            if docker:
                await inner.close()  # stdin EOF: pi exits (never killpg a container pid from the host)
                with anyio.move_on_after(10):
                    await inner.wait()
            else:
                await inner.kill()
    finally:
        if container:
            subprocess.run(["docker", "rm", "-f", container], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def parser_throughput(rounds: int) -> None:
    streams = {p.stem: [line for d, line in load_stream(p) if d == "out"] for p in sorted(DATA.glob("*.jsonl"))}
    n_lines = sum(len(v) for v in streams.values())
    n_bytes = sum(len(x) for v in streams.values() for x in v)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for lines in streams.values():
            turn = PiTurn(prompt_id="p2")
            for i, line in enumerate(lines):
                obj = parse_json_line(line)
                if obj is not None:
                    step = turn.feed(obj)
                    if step.send_barrier:
                        turn.barrier_sent(f"b{i}")
    dt = time.perf_counter() - t0
    events = n_lines * rounds
    print(f"tracker (json decode + PiTurn.feed): {events / dt:10.0f} events/s   {n_bytes * rounds / dt / 1e6:6.1f} MB/s"
          f"   ({events} events, {len(streams)} recordings)")

    async def sessions() -> tuple[int, float]:
        count = 0
        t0 = time.perf_counter()
        for _ in range(max(1, rounds // 10)):
            count += await one_round()
        return count, time.perf_counter() - t0

    from tests.unit.test_pi_support import launch_for, recorded_locator

    recorded = {name: load_stream(DATA / f"{name}.jsonl")
                for name in ("tool_call", "terminal_400", "retry_success", "retry_exhausted", "overflow_stale")}

    async def one_round() -> int:
        count = 0
        for entries in recorded.values():
            transport = ScriptedPiTransport(entries)
            session = PiSession(transport, launch_for(recorded_locator(entries)), PiSettings())
            await session.handshake()
            for d, raw in entries:
                if d == "in" and json.loads(raw)["type"] == "prompt":
                    await session.run_turn(json.loads(raw)["message"], timeout_s=10)
            count += len(transport.delivered)
        return count

    total, dt = anyio.run(sessions)
    print(f"session over scripted transport:     {total / dt:10.0f} events/s   ({total} events)")


def main() -> None:
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--docker", action="store_true", help="run pi inside the pinned image")
    ap.add_argument("--no-cli", action="store_true", help="parser throughput only")
    args = ap.parse_args()
    parser_throughput(args.rounds)
    if not args.no_cli:
        image = None
        if args.docker:
            image = subprocess.run([sys.executable, "-m", "images.build"], cwd=ROOT, check=True, capture_output=True,
                                   text=True).stdout.strip().splitlines()[-1]
        anyio.run(settlement_latency, args.turns, image)


if __name__ == "__main__":
    main()
