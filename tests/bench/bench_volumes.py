"""State volumes (issue 15), side by side in one run, per CLI: a RESTORED turn after the
container was lost (``docker rm -f``: a new container on the chat's state volume) against a
RESTORED turn after an idle stop (the same container started again).

    uv run python tests/bench/bench_volumes.py [--rounds 3] [--runtimes claude,codex,pi,opencode,kilo]

One in-process daemon (real HTTP API, real Docker, the real pinned CLIs, sealed) and the
loopback fixture. Each round runs, per CLI, one chat: NEW, then either "stop" or "loss"
first (alternating by round), then the other, each followed by a RESTORED turn with the
exact history (asserted, as in the regression suite). Printed per CLI: the median receipt
``timings_ms`` (total and its sandbox part) of each kind of RESTORED turn and the ratio
loss ÷ stop.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import anyio
import docker

from deploy.loopback import LoopbackFixture
from images.build import ensure_image
from tests.daemon_harness import daemon_settings
from tests.regression.conftest import recorded_daemon, remove_host_containers
from tests.regression.history_helpers import Member, token

RUNTIMES = ["claude", "codex", "pi", "opencode", "kilo"]


async def bench(runtimes: list[str], rounds: int) -> int:
    image = ensure_image()
    client = docker.from_env()
    results: dict[str, dict[str, list[tuple[int, int]]]] = {r: {"stop": [], "loss": []} for r in runtimes}
    with tempfile.TemporaryDirectory(prefix="bench-volumes-") as tmp, LoopbackFixture.start() as fx:
        settings = daemon_settings(Path(tmp) / "home", fx.base_url, image)
        try:
            async with recorded_daemon(settings) as d:
                for i in range(rounds):
                    for runtime in runtimes:
                        m = Member(d, fx, runtime)
                        first = await m.turn(token(f"round {i}: remember the word anemone"), "NEW")
                        order = ("stop", "loss") if i % 2 == 0 else ("loss", "stop")
                        for kind in order:
                            if kind == "stop":
                                await m.stop()
                            else:
                                rec = await d.daemon.supervisor.store.get_sandbox(m.user_id, m.chat_id)
                                client.api.remove_container(rec.container_id, force=True)
                            t = await m.turn(token(f"after the {kind}: which word?"), "RESTORED")
                            ms = t.receipt["timings_ms"]
                            results[runtime][kind].append((ms["total"], ms["sandbox"]))
                        assert first.receipt["sandbox"]["volume"]
                        print(f"  round {i} {runtime}: " + ", ".join(
                            f"{k} {results[runtime][k][-1][0]} ms" for k in order), file=sys.stderr, flush=True)
        finally:
            remove_host_containers(client, settings.resolved_host_id())
            client.close()
    print(f"\nRESTORED after container loss vs after a stop ({rounds} rounds, median ms)")
    print(f"{'cli':<9} {'stop total':>10} {'(sandbox)':>9} {'loss total':>10} {'(sandbox)':>9} {'loss/stop':>9}")
    for runtime, r in results.items():
        stop_t = statistics.median(x[0] for x in r["stop"])
        stop_s = statistics.median(x[1] for x in r["stop"])
        loss_t = statistics.median(x[0] for x in r["loss"])
        loss_s = statistics.median(x[1] for x in r["loss"])
        print(f"{runtime:<9} {stop_t:>10.0f} {stop_s:>9.0f} {loss_t:>10.0f} {loss_s:>9.0f} {loss_t / stop_t:>9.2f}")
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runtimes", default=",".join(RUNTIMES))
    args = p.parse_args()
    return anyio.run(bench, args.runtimes.split(","), args.rounds)


if __name__ == "__main__":
    sys.exit(main())
