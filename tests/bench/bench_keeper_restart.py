"""Daemon restarts under keepers (SPEC 14), through the HTTP API of a daemon subprocess.

    uv run python tests/bench/bench_keeper_restart.py [RUNTIME] [CHATS] [RESTARTS] [HOLD_S]

Defaults: codex, 4 chats, 3 restarts, replies held 30 s. Each round: every chat has a turn in
flight (the fixture holds each reply mid-stream), the daemon is killed with ``kill -9``, a new
one starts; every held turn must be committed exactly once by the new daemon and the next turn
of each chat must be ``LIVE`` (tests/support/restarts.py; the suite runs a smaller matrix in
tests/cli/test_keeper_restart.py). Printed side by side in one run: a LIVE turn, a RESTORED
turn (after a retire: what every turn after a restart cost before keepers), and the time from
the daemon's start to its first re-adopted LIVE turn.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path

import anyio
import docker

from deploy.loopback import LoopbackFixture
from images.build import ensure_image
from tests.daemon_harness import test_host_id
from tests.regression.conftest import remove_host_containers
from tests.support.proxy_services import end_strays
from tests.support.restarts import run_restart_rounds


def med(xs: list[float]) -> str:
    return f"p50 {statistics.median(xs):8.1f} ms  (n={len(xs)}, min {min(xs):.1f}, max {max(xs):.1f})"


async def main(runtime: str, n_chats: int, restarts: int, hold_s: float) -> None:
    image = ensure_image()
    home = Path(tempfile.mkdtemp(prefix="bench-keeper-restart-")) / "home"
    try:
        with LoopbackFixture.start() as fx:
            r = await run_restart_rounds(fx, home, image, runtime, n_chats, restarts, hold_s=hold_s, timings=True)
    finally:
        # the residents live on under their keepers after the last daemon (that is the point):
        # the bench removes its sandboxes and volumes and stops its proxy service itself
        remove_host_containers(docker.from_env(), test_host_id(home))
        end_strays({home}, None)
    print(f"{runtime}: {n_chats} chats, {restarts} kill -9 restarts, each with {n_chats} turns in flight")
    print(f"LIVE turn                           {med(r.live_ms)}")
    print(f"RESTORED turn (after a retire)      {med(r.restored_ms)}   "
          f"ratio {statistics.median(r.restored_ms) / statistics.median(r.live_ms):.1f}x")
    print(f"daemon start to /healthz            {med(r.ready_ms)}")
    print(f"daemon start to first LIVE receipt  {med(r.first_live_ms)}  (re-adopted keeper)")
    print(f"turns in flight committed once: {r.committed_once} of {r.held}")
    print("problems:", r.problems or "none")


if __name__ == "__main__":
    args = sys.argv[1:]
    anyio.run(main, args[0] if args else "codex", int(args[1]) if len(args) > 1 else 4,
              int(args[2]) if len(args) > 2 else 3, float(args[3]) if len(args) > 3 else 30.0)
