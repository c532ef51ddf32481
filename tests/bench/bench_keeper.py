"""A line round trip through ca-keeper vs a direct attached exec of the same echo process.

    uv run python tests/bench/bench_keeper.py [N]

One container from the pinned image (network none, init). The same echo CLI
(tests/support/keeper_fake_cli.py) runs three times: as a plain attached exec driven through
ExecStream, under ca-keeper driven through KeeperChannel over its start's attached exec (the
relay, then the keeper), and under another ca-keeper linked from the host once started
(sandbox_manager.keeper_link: the keeper's socket, no exec). Samples rotate between the
three, so load on the machine hits all alike. Prints p50/p99 of each, the added time at p50
(goal: <= 1 ms), and the cost of a re-attach (one attached exec + hello, or a link from the
host + hello) next to a fresh keeper start.
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
from sandbox_manager.keeper_link import SocketBytes
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
        # a second keeper, linked from the host once started (what the daemon does)
        linked_paths = KeeperPaths.in_run_dir("/home/agent/members/bench-linked/run")
        init_pid = (await engine.inspect(info.id)).attrs["State"]["Pid"]
        linked = await keeper_sandbox.go_direct(await keeper_sandbox.start(
            engine, info.id, [*run_prefix(linked_paths, member="bench-linked"), "--pidfile", linked_paths.cli_pidfile,
                              "--", *cli], auto_ack_bytes=64 * 1024), init_pid, linked_paths)
        assert isinstance(linked.stream, SocketBytes), "the host could not link to the keeper's socket"
        await linked.receive()

        d_ms: list[float] = []
        k_ms: list[float] = []
        l_ms: list[float] = []
        arms = [(direct, d_ms), (kept, k_ms), (linked, l_ms)]
        for i in range(n + 100):
            for stream, out in arms[i % 3:] + arms[:i % 3]:
                t = time.perf_counter()
                await stream.send(LINE)
                line = await stream.receive()
                dt = (time.perf_counter() - t) * 1000
                assert line == LINE, line
                if i >= 100:  # warm-up
                    out.append(dt)

        attach_ms: list[float] = []
        linked_attach_ms: list[float] = []
        ident = kept.identity
        for i in range(40):  # alternately through an exec and from the host
            await kept.detach()
            t = time.perf_counter()
            kept = await keeper_sandbox.attach(engine, info.id, paths, from_offset=kept.acked, expect=ident,
                                               auto_ack_bytes=64 * 1024, init_pid=init_pid if i % 2 else None)
            (linked_attach_ms if i % 2 else attach_ms).append((time.perf_counter() - t) * 1000)
            assert isinstance(kept.stream, SocketBytes) == bool(i % 2)
        await kept.send(LINE)
        assert await kept.receive() == LINE

        print(f"line round trip ({len(LINE) + 1} bytes each way), {n} samples each, interleaved")
        print(row("direct attached exec", d_ms))
        print(row("ca-keeper, its exec's relay", k_ms))
        print(row("ca-keeper, linked from host", l_ms))
        for name, samples in (("relay", k_ms), ("host link", l_ms)):
            p50, p99 = pct(samples, 0.5), pct(samples, 0.99)
            print(f"{name}: added at p50 {p50 - pct(d_ms, 0.5):.3f} ms (goal <= 1 ms)   ratio p50 "
                  f"{p50 / pct(d_ms, 0.5):.2f}x   added at p99 {p99 - pct(d_ms, 0.99):.3f} ms")
        print(f"keeper start (one attached exec, to the CLI's first line): {start_ms:.1f} ms")
        print(row("re-attach (exec + hello)", attach_ms))
        print(row("re-attach (host link + hello)", linked_attach_ms))
        await kept.shutdown()
        await linked.shutdown()
        await direct.aclose()
    finally:
        await engine.remove(info.id)
        engine.close()


if __name__ == "__main__":
    anyio.run(main, int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
