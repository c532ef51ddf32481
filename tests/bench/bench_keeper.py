"""A line round trip through ca-keeper vs a direct attached exec of the same echo process.

    uv run python tests/bench/bench_keeper.py [N]

One container from the pinned image (network none, init). The same echo CLI
(tests/support/keeper_fake_cli.py) runs twice: once as a plain attached exec driven through
ExecStream, once under ca-keeper driven through KeeperChannel (itself over an attached exec:
the relay, then the keeper). Samples alternate between the two, so load on the machine
hits both alike. Prints p50/p99 of each, the added time at p50 (goal: <= 1 ms), and the
cost of a re-attach (one attached exec + hello) next to a fresh keeper start.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid

import anyio

from images.build import ensure_image
from sandbox_manager import keeper_sandbox
from sandbox_manager.engine import ContainerSpec, DockerEngine, FileEntry
from sandbox_manager.keeper_sandbox import KeeperPaths, run_prefix
from tests.support.keeper_local import FAKE_CLI

FAKE = "/home/agent/bench/fake_cli.py"
LINE = b'{"op":"echo","payload":"' + b"x" * 200 + b'"}'


def pct(samples: list[float], q: float) -> float:
    s = sorted(samples)
    return s[min(len(s) - 1, int(q * len(s)))]


def row(name: str, samples: list[float]) -> str:
    return (f"{name:<28} p50 {pct(samples, 0.5):7.3f} ms   p99 {pct(samples, 0.99):7.3f} ms   "
            f"mean {statistics.fmean(samples):7.3f} ms   n={len(samples)}")


async def main(n: int) -> None:
    engine = DockerEngine()
    spec = ContainerSpec(image=ensure_image(), name=f"ca-bench-keeper-{uuid.uuid4().hex[:8]}",
                         labels={"org.cloud-agent.bench": "keeper"})
    info = await engine.create(spec)
    try:
        await engine.start(info.id)
        await engine.put_files(info.id, [FileEntry(FAKE, FAKE_CLI.read_bytes())], [])
        cli = ["python3", "-I", "-S", FAKE]
        direct = await engine.exec_attached(info.id, cli)
        await direct.receive()  # ready
        paths = KeeperPaths.in_run_dir("/home/agent/members/bench/run")
        argv = [*run_prefix(paths, member="bench"), "--pidfile", paths.cli_pidfile, "--", *cli]
        t = time.perf_counter()
        kept = await keeper_sandbox.start(engine, info.id, argv, auto_ack_bytes=64 * 1024)
        await kept.receive()
        start_ms = (time.perf_counter() - t) * 1000

        d_ms: list[float] = []
        k_ms: list[float] = []
        for i in range(n + 100):
            for stream, out in ((direct, d_ms), (kept, k_ms)) if i % 2 else ((kept, k_ms), (direct, d_ms)):
                t = time.perf_counter()
                await stream.send(LINE)
                line = await stream.receive()
                dt = (time.perf_counter() - t) * 1000
                assert line == LINE, line
                if i >= 100:  # warm-up
                    out.append(dt)

        attach_ms: list[float] = []
        ident = kept.identity
        for _ in range(20):
            await kept.detach()
            t = time.perf_counter()
            kept = await keeper_sandbox.attach(engine, info.id, paths, from_offset=kept.acked, expect=ident,
                                               auto_ack_bytes=64 * 1024)
            attach_ms.append((time.perf_counter() - t) * 1000)
        await kept.send(LINE)
        assert await kept.receive() == LINE

        print(f"line round trip ({len(LINE) + 1} bytes each way), {n} samples each, interleaved")
        print(row("direct attached exec", d_ms))
        print(row("through ca-keeper", k_ms))
        added = pct(k_ms, 0.5) - pct(d_ms, 0.5)
        print(f"added at p50: {added:.3f} ms (goal <= 1 ms)   ratio p50 {pct(k_ms, 0.5) / pct(d_ms, 0.5):.2f}x   "
              f"added at p99: {pct(k_ms, 0.99) - pct(d_ms, 0.99):.3f} ms")
        print(f"keeper start (one attached exec, to the CLI's first line): {start_ms:.1f} ms")
        print(row("re-attach (exec + hello)", attach_ms))
        await kept.shutdown()
        await direct.aclose()
    finally:
        await engine.remove(info.id)
        engine.close()


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
