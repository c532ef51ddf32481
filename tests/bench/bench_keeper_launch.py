"""A CLI's launch to its first line: under ca-keeper vs ca-launch on a plain attached exec,
for one or more sandbox images side by side (issue 16).

    uv run python tests/bench/bench_keeper_launch.py [N] [--image REF]...

One container per image (network none, init), the same echo CLI in each
(tests/support/keeper_fake_cli.py, which prints a line as it starts). Per sample and image:
``ca-keeper run ... -- CLI`` (what a NEW or RESTORED turn starts: the keeper's hello, then the
CLI's first line through it) and ``ca-launch ... -- CLI`` on its own attached exec (the bare
path). Samples alternate between arms and images, so load hits all alike. Without
``--image`` the current image (images.build.ensure_image) is measured; pass an older image's
tag too to compare helpers before and after a change.
"""

from __future__ import annotations

import argparse
import statistics
import time
import uuid

import anyio

from images.build import ensure_image
from sandbox_manager import keeper_sandbox
from sandbox_manager.engine import ContainerSpec, DockerEngine, FileEntry
from sandbox_manager.keeper_sandbox import KeeperPaths, run_prefix
from tests.support.keeper_local import FAKE_CLI

FAKE = "/home/agent/bench/fake_cli.py"
CLI = ["python3", "-I", "-S", FAKE]


async def keeper_launch(engine: DockerEngine, cid: str) -> float:
    paths = KeeperPaths.in_run_dir(f"/home/agent/members/b{uuid.uuid4().hex[:8]}/run")
    argv = [*run_prefix(paths, member="bench"), "--pidfile", paths.cli_pidfile, "--", *CLI]
    t = time.perf_counter()
    channel = await keeper_sandbox.start(engine, cid, argv, auto_ack_bytes=64 * 1024)
    first = await channel.receive()
    ms = (time.perf_counter() - t) * 1000
    assert first, "the CLI wrote nothing"
    await channel.shutdown()
    return ms


async def plain_launch(engine: DockerEngine, cid: str) -> float:
    pidfile = f"/home/agent/members/b{uuid.uuid4().hex[:8]}/run/cli.pid"
    t = time.perf_counter()
    stream = await engine.exec_attached(cid, ["ca-launch", "--pidfile", pidfile, "--", *CLI])
    first = await stream.receive()
    ms = (time.perf_counter() - t) * 1000
    assert first, "the CLI wrote nothing"
    await stream.aclose()
    await engine.exec_run(cid, ["sh", "-c", 'kill -KILL -- "-$(cat "$1")"', "sh", pidfile])
    return ms


async def main(n: int, images: list[str]) -> None:
    engine = DockerEngine()
    containers: dict[str, str] = {}
    try:
        for image in images:
            info = await engine.create(ContainerSpec(image=image, name=f"ca-bench-launch-{uuid.uuid4().hex[:8]}",
                                                     labels={"org.cloud-agent.bench": "keeper-launch"}))
            containers[image] = info.id
            await engine.start(info.id)
            await engine.put_files(info.id, [FileEntry(FAKE, FAKE_CLI.read_bytes())], [])
        samples: dict[tuple[str, str], list[float]] = {(i, a): [] for i in images for a in ("keeper", "ca-launch")}
        for k in range(n + 2):
            order = [(i, a) for i in images for a in ("keeper", "ca-launch")]
            for image, arm in order if k % 2 else reversed(order):
                fn = keeper_launch if arm == "keeper" else plain_launch
                ms = await fn(engine, containers[image])
                if k >= 2:  # warm-up
                    samples[(image, arm)].append(ms)
        print(f"launch to the CLI's first line, {n} samples each, alternated (p50 ms, min-max)")
        for image in images:
            k_ms, p_ms = samples[(image, "keeper")], samples[(image, "ca-launch")]
            print(f"{image:40} keeper {statistics.median(k_ms):6.1f} ({min(k_ms):.1f}-{max(k_ms):.1f})   "
                  f"ca-launch {statistics.median(p_ms):6.1f} ({min(p_ms):.1f}-{max(p_ms):.1f})   "
                  f"keeper ÷ ca-launch {statistics.median(k_ms) / statistics.median(p_ms):.3f}")
        if len(images) > 1:
            base = images[0]
            for image in images[1:]:
                for arm in ("keeper", "ca-launch"):
                    ratio = statistics.median(samples[(image, arm)]) / statistics.median(samples[(base, arm)])
                    print(f"{arm:9} {image} ÷ {base}: {ratio:.3f}")
    finally:
        for cid in containers.values():
            await engine.remove(cid)
        engine.close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("n", nargs="?", type=int, default=20)
    ap.add_argument("--image", action="append", help="an image to measure (repeat to compare; default: the current)")
    args = ap.parse_args()
    anyio.run(main, args.n, args.image or [ensure_image()])
