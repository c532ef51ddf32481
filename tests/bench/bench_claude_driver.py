"""Claude driver benchmark (a script, not a test).

    uv run python tests/bench/bench_claude_driver.py [--turns 15] [--no-cli]

Printed side by side:

* **parser throughput** over the recorded 2.1.220 streams (tests/data/claude/): events/s
  through ``TurnTracker.feed`` alone (JSON decode + normalize + settlement rule), and through
  the whole session path (scripted transport -> ``read_object`` -> ``run_turn``);
* **last event -> Settlement**: the time from the CLI's last line of a turn (the ``idle``)
  to ``run_turn`` returning, against the real pinned CLI in the pinned image and the
  loopback fixture, with the transcript-flush window (``persist_grace_s``, default) and
  without it (the driver's own overhead); plus the whole turn's wall time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402

from drivers.claude import ClaudeDriver, ClaudeSettings  # noqa: E402
from drivers.claude.wire import TurnTracker  # noqa: E402
from drivers.transport import TransportWrapper  # noqa: E402
from tests.unit.test_claude_replay import load_stream, make_session  # noqa: E402

NAMES = ["success", "live", "failure_400", "context_400", "retry", "tool", "child_agent", "background_origin",
         "interrupt", "restored", "slash"]


def _quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(40))


def bench_parser(rounds: int) -> None:
    streams = {n: [json.dumps(o).encode() for d, o in load_stream(n)[1] if d == "recv"] for n in NAMES}
    total_lines = sum(len(v) for v in streams.values())
    total_bytes = sum(len(x) for v in streams.values() for x in v)
    t0 = time.perf_counter()
    for _ in range(rounds):
        for lines in streams.values():
            t = TurnTracker("x")
            for line in lines:
                t.feed(json.loads(line))
    dt = time.perf_counter() - t0
    print(f"parser  TurnTracker.feed (+json.loads): {rounds * total_lines / dt:,.0f} events/s  "
          f"{rounds * total_bytes / dt / 1e6:,.1f} MB/s  ({total_lines} recorded events x {rounds})")

    turn_streams = [n for n in NAMES if n not in ("interrupt", "live")]

    async def sessions() -> int:
        events = 0
        for _ in range(max(1, rounds // 10)):
            for name in turn_streams:
                header, steps = load_stream(name)
                s, t = make_session(steps, header["expected"])
                await s.handshake()
                await s.run_turn("x")
                events += t.received
        return events

    t0 = time.perf_counter()
    events = anyio.run(sessions)
    dt = time.perf_counter() - t0
    print(f"session handshake+run_turn over a scripted transport: {events / dt:,.0f} events/s  "
          f"({events} events in {dt:.2f}s)")


class TimingTransport(TransportWrapper):
    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.last_recv = 0.0

    async def receive(self) -> bytes | None:
        line = await self.inner.receive()
        self.last_recv = time.perf_counter()
        return line


async def bench_cli(turns: int) -> None:
    import os

    import docker

    from drivers.models import MemberPaths, Settlement
    from tests.support.local_process import LocalProcessTransport
    from images.build import ensure_image

    image = ensure_image()
    root = Path(tempfile.mkdtemp(prefix="ca-claude-bench-", dir="/var/tmp"))
    root.chmod(0o755)
    client = docker.from_env()
    from tests.support.sealed import MODELGATE_COMMAND, sealed_fixture, sealed_volumes

    container = client.containers.run(image, MODELGATE_COMMAND, detach=True, init=True, network_mode="none",
                                      user="agent", volumes={str(root): {"bind": str(root), "mode": "rw"},
                                                             **sealed_volumes(root / ".model")},
                                      labels={"cloud-agent.test": "claude-bench"})
    try:
        async with sealed_fixture(root / ".model", "sk-bench-key") as (fx, gate):
            gw = gate.gateway(model="fixture-model")
            default = ClaudeSettings().persist_grace_s
            for label, grace in ((f"persist_grace_s={default:g} (default)", default), ("persist_grace_s=0", 0.0)):
                driver = ClaudeDriver(ClaudeSettings(persist_grace_s=grace))
                base = root / label.split()[0].replace("=", "-")
                paths = MemberPaths(home=str(base / "home"), workspace=str(base / "ws"), run_dir=str(base / "run"))
                launch = driver.plan(paths, gw, None)
                launch.spec.materialize_files_locally()
                for dirpath, dirnames, filenames in os.walk(root):
                    for n in [*dirnames, *filenames]:
                        os.lchown(os.path.join(dirpath, n), 1000, 1000)
                inner = await LocalProcessTransport.start(
                    launch.spec, launcher=("ca-launch",), run_dir=Path(paths.run_dir),
                    exec_prefix=("docker", "exec", "-i", "-u", "agent", container.id))
                timing = TimingTransport(inner)
                s = driver.session(timing, launch)
                t0 = time.perf_counter()
                await s.handshake()
                ready = time.perf_counter() - t0
                lat, wall = [], []
                for i in range(turns):
                    t0 = time.perf_counter()
                    out = await s.run_turn(f"bench turn {i}", timeout_s=60)
                    done = time.perf_counter()
                    assert isinstance(out, Settlement) and not out.is_error, out
                    lat.append((done - timing.last_recv) * 1000)
                    wall.append((done - t0) * 1000)
                await s.close()
                with anyio.move_on_after(10):
                    await inner.wait()
                print(f"cli     {label:32s} last event -> Settlement: median {statistics.median(lat):7.2f} ms  "
                      f"p90 {sorted(lat)[int(len(lat) * 0.9) - 1]:7.2f} ms | turn wall median "
                      f"{statistics.median(wall):6.1f} ms | handshake {ready * 1000:.0f} ms  ({turns} turns)")
    finally:
        container.remove(force=True)
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--turns", type=int, default=15)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--no-cli", action="store_true")
    args = ap.parse_args()
    _quiet()
    bench_parser(args.rounds)
    if not args.no_cli:
        anyio.run(bench_cli, args.turns)


if __name__ == "__main__":
    main()
