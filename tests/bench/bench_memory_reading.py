"""What a resident memory reading costs with PSS and without it (a script, not a test).

    uv run python tests/bench/bench_memory_reading.py [--rounds 20] [--comm node]

``sandbox_manager.proc_memory.ProcMemory`` reads each resident CLI's processes: ``stat`` and
``status`` for RSS and its peak (what the budget counts), and ``smaps_rollup`` for PSS (only
the ``cloud_agent_resident_memory_pss_bytes`` gauge uses it). This reads every host process
whose command name is ``--comm`` (a CLI's Node runtime by default; run it while residents are
up), both ways in alternation, and prints the CPU time per process of each and their ratio.
The daemon's periodic check reads PSS; the readings a launch or a turn waits for do not.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from sandbox_manager.proc_memory import ProcMemory


def pids_named(comm: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == comm:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--comm", default="node", help="the command name of the processes to read")
    args = ap.parse_args()
    pids = pids_named(args.comm)
    if not pids:
        raise SystemExit(f"no process named {args.comm!r}: start some residents first")
    reader = ProcMemory()
    times: dict[str, list[float]] = {"rss only": [], "rss and pss": []}
    for i in range(args.rounds * 2):
        arm = "rss only" if i % 2 == 0 else "rss and pss"
        t = time.thread_time()
        for pid in pids:
            reader._read(pid)  # noqa: SLF001 - the reading's own parts, timed apart
            if arm == "rss and pss":
                reader._pss(pid)  # noqa: SLF001
        times[arm].append((time.thread_time() - t) * 1000 / len(pids))
    rss, both = statistics.median(times["rss only"]), statistics.median(times["rss and pss"])
    print(f"{len(pids)} {args.comm} processes, {args.rounds} rounds per arm: CPU ms per process (p50)")
    print(f"rss only {rss:.3f}   rss and pss {both:.3f}   ratio {rss / both:.3f}")


if __name__ == "__main__":
    main()
