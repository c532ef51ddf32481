"""Baseline: raw Docker SDK operations on the pinned image (the floor under everything).

    uv run python tests/bench/bench_docker_sdk.py [N]

Prints medians (min-max) of create, start, exec round trip (`true`), an attached-exec line
round trip through sandbox_manager's ExecStream, and stop (init=True), in one run.
"""

from __future__ import annotations

import statistics
import sys
import time

import anyio
import docker

from images.build import ensure_image
from sandbox_manager.engine import DockerEngine


def ms(samples: list[float]) -> str:
    s = sorted(samples)
    return f"{statistics.median(s):7.1f} ms  ({s[0]:.1f}-{s[-1]:.1f}, n={len(s)})"


def main(n: int = 10) -> None:
    image = ensure_image()
    client = docker.from_env()
    create, start, exec_rt, stop, remove = [], [], [], [], []
    for _ in range(n):
        t = time.perf_counter()
        c = client.containers.create(image, command=["sleep", "infinity"], init=True, network_mode="none",
                                     user="agent")
        create.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        c.start()
        start.append((time.perf_counter() - t) * 1000)
        for _ in range(3):
            t = time.perf_counter()
            c.exec_run(["true"])
            exec_rt.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        c.stop(timeout=5)
        stop.append((time.perf_counter() - t) * 1000)
        t = time.perf_counter()
        c.remove()
        remove.append((time.perf_counter() - t) * 1000)

    async def attached() -> list[float]:
        engine = DockerEngine()
        c = client.containers.run(image, command=["sleep", "infinity"], init=True, network_mode="none",
                                  user="agent", detach=True)
        try:
            s = await engine.exec_attached(c.id, ["cat"])
            out = []
            for _ in range(200):
                t = time.perf_counter()
                await s.send(b'{"ping": 1}')
                await s.receive()
                out.append((time.perf_counter() - t) * 1000)
            await s.close()
            await s.aclose()
            return out
        finally:
            c.remove(force=True)

    line_rt = anyio.run(attached)
    print(f"image {image}")
    print(f"create                 {ms(create)}")
    print(f"start                  {ms(start)}")
    print(f"exec_run(true)         {ms(exec_rt)}")
    print(f"stop (init=True)       {ms(stop)}")
    print(f"remove                 {ms(remove)}")
    print(f"attached line echo     {ms(line_rt)}")
    print(f"ratio exec_run / line  {statistics.median(exec_rt) / statistics.median(line_rt):.0f}x")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 10)
