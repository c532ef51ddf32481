"""What sealing costs each CLI (issue 12): NEW, LIVE and RESTORED turns, sealed vs direct,
side by side in one run.

    uv run python tests/bench/bench_sealed.py [--rounds 5] [--live 5] [--runtimes claude,codex,pi,opencode,kilo]
                                              [--steady N]

Both arms drive the same pinned CLI with the same driver in the same sealed sandbox (network
``none``, one container per CLI); only the way to the model differs:

* ``sealed`` — the product's path: the CLI → ``127.0.0.1:<port>`` in the sandbox (ca-modelgate)
  → the sandbox's unix socket → the daemon's model proxy (key swap, allow-list, wire audit)
  → the loopback fixture, a process on the host;
* ``direct`` — the unsealed design's network path (the CLI's TCP connection on loopback
  straight to the model), without host networking: a second loopback fixture process runs on
  the host *inside the sandbox's own network namespace* (``nsenter --net``), listening on the
  sandbox's 127.0.0.1, and the CLI's base URL points at it. Nothing leaves loopback and the
  sandbox keeps network ``none``; the earlier "before" arm (a daemon with host networking) is
  not run: no sandbox may use host networking, not in benches either.

A turn is timed around the driver calls, as the supervisor makes them: NEW = launch, handshake
and the first turn; LIVE = one more turn on the same process (the median of ``--live``);
RESTORED = the process retired (its group killed), then launch with the saved locator,
resume handshake and a turn. Arms alternate which goes first each round; every turn of each
arm must reach its own fixture only (checked from the fixtures' request counts). Printed per
CLI: the medians and sealed ÷ direct (goal: no CLI slower by more than 5%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import docker
from pydantic import SecretStr

from drivers.models import GatewayConfig, Locator
from images.build import ensure_image
from runner.config import LOOPBACK_KEY
from runner.processes import member_paths, start_in_sandbox
from runner.transport import exec_transport
from tests.daemon_harness import daemon_settings, running_daemon
from tests.regression.conftest import remove_host_containers

REPO = Path(__file__).resolve().parents[2]
RUNTIMES = ("claude", "codex", "pi", "opencode", "kilo")
PHASES = ("NEW", "LIVE", "RESTORED")
DIRECT_PORT = 18555  # in the sandbox's own network namespace (ca-modelgate has 18080)


@contextmanager
def fixture_process(port: int, *, netns_pid: int | None = None) -> Iterator[str]:
    """``python -m deploy.loopback`` on 127.0.0.1:``port`` — of the host, or of the network
    namespace of process ``netns_pid`` (a sandbox's init). Yields its control token."""
    token_file = Path(tempfile.mkdtemp(prefix="bench-sealed-")) / "token"
    argv = [sys.executable, "-m", "deploy.loopback", "--port", str(port), "--token-file", str(token_file),
            "--exit-on-stdin-eof"]
    if netns_pid is not None:
        argv = ["nsenter", f"--net=/proc/{netns_pid}/ns/net", "--", *argv]
    proc = subprocess.Popen(argv, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # its first line says it listens
        if proc.poll() is not None or not line:
            raise RuntimeError(f"fixture did not start: {line!r}")
        deadline = time.monotonic() + 10
        while not token_file.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        yield token_file.read_text().strip()
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def host_fixture_times(port: int, token: str) -> list[float]:
    """The arrival time (Unix) of every request the host's fixture recorded, in order."""
    req = urllib.request.Request(f"http://127.0.0.1:{port}/_fixture/requests",
                                 headers={"authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return [r["time"] for r in json.loads(resp.read())["requests"]]


def in_netns_times(pid: int, token: str) -> list[float]:
    """The direct fixture's request arrival times, asked from inside the sandbox's namespace."""
    code = ("import json,sys,urllib.request as u;"
            f"r=u.Request('http://127.0.0.1:{DIRECT_PORT}/_fixture/requests',"
            f"headers={{'authorization':'Bearer {token}'}});"
            "print(json.dumps([x['time'] for x in json.loads(u.urlopen(r,timeout=10).read())['requests']]))")
    out = subprocess.run(["nsenter", f"--net=/proc/{pid}/ns/net", "--", sys.executable, "-c", code],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


@dataclass
class Arm:
    name: str
    gateway: GatewayConfig
    member: str
    times: dict[str, list[float]] = field(default_factory=lambda: {p: [] for p in PHASES})
    requests: list[int] = field(default_factory=list)  # model requests per round (NEW + LIVE turns + RESTORED)


class Member:
    """One member's CLI driven as the supervisor drives it, on an exec in the chat's sandbox."""

    def __init__(self, sup: Any, sandbox: Any, runtime: str, arm: Arm) -> None:
        self.sup, self.sandbox, self.runtime, self.arm = sup, sandbox, runtime, arm
        self.driver = sup.runner.driver(runtime)
        self.dirs = sup.manager.member_dirs(arm.member)
        self.session: Any = None
        self.proc: Any = None
        self.locator: Locator | None = None

    async def start(self, resume: Locator | None) -> None:
        launch = self.driver.plan(member_paths(self.dirs), self.arm.gateway, resume)
        self.proc = await start_in_sandbox(self.sup.manager, self.sandbox, self.dirs, launch, name="bench")
        self.session = self.driver.session(exec_transport(self.proc.stream), launch)
        await self.session.handshake()

    async def turn(self, message: str) -> None:
        out = await self.session.run_turn(message, emit=lambda ev: None, timeout_s=300)
        assert not getattr(out, "is_error", True) and getattr(out, "observed_locator", None), out
        self.locator = self.session.locator = out.observed_locator

    async def retire(self) -> None:
        await self.session.close(3.0)
        await self.sup.manager.kill_group(self.proc.container_id, self.proc.pidfile)
        await self.session.transport.close()


async def one_round(sup: Any, sandbox: Any, runtime: str, arm: Arm, live: int, r: int) -> None:
    m = Member(sup, sandbox, runtime, arm)
    t = time.perf_counter()
    await m.start(None)
    await m.turn(f"{arm.name} round {r}: the first message")
    arm.times["NEW"].append((time.perf_counter() - t) * 1000)
    lives = []
    for i in range(live):
        t = time.perf_counter()
        await m.turn(f"{arm.name} round {r}: live {i}")
        lives.append((time.perf_counter() - t) * 1000)
    arm.times["LIVE"].append(statistics.median(lives))
    await m.retire()
    t = time.perf_counter()
    await m.start(m.locator)
    await m.turn(f"{arm.name} round {r}: after the restore")
    arm.times["RESTORED"].append((time.perf_counter() - t) * 1000)
    await m.retire()


async def bench_runtime(sup: Any, runtime: str, rounds: int, live: int, host: tuple[int, str]) -> dict[str, Arm]:
    user, chat = "bench", f"sealed-{runtime}-{uuid.uuid4().hex[:6]}"
    await sup.model_path.open(user, chat)
    sandbox = await sup.manager.resolve(user, chat)
    pid = sandbox.container.attrs["State"]["Pid"]
    model = sup.runner.models[runtime]
    with fixture_process(DIRECT_PORT, netns_pid=pid) as direct_token:
        direct_gw = GatewayConfig(base_url=f"http://127.0.0.1:{DIRECT_PORT}", key=SecretStr(LOOPBACK_KEY), model=model)
        arms = {"sealed": None, "direct": None}
        for r in range(rounds):
            order = ("sealed", "direct") if r % 2 == 0 else ("direct", "sealed")
            for name in order:
                member = f"{name}-{r}"
                gw = await sup.runner.gateway(runtime, user, chat, member) if name == "sealed" else direct_gw
                arm = arms[name] or Arm(name, gw, member)
                arm.gateway, arm.member = gw, member  # a fresh member (NEW) each round
                arms[name] = arm
                before = (len(host_fixture_times(*host)), len(in_netns_times(pid, direct_token)))
                await one_round(sup, sandbox, runtime, arm, live, r)
                after = (len(host_fixture_times(*host)), len(in_netns_times(pid, direct_token)))
                grew = (after[0] - before[0], after[1] - before[1])
                arm.requests.append(max(grew))
                # each arm reached its own model only
                assert (grew[0] > 0 and grew[1] == 0) if name == "sealed" else (grew[0] == 0 and grew[1] > 0), \
                    (runtime, name, grew)
    await sup.model_path.close(user, chat)
    return {k: v for k, v in arms.items() if v is not None}


async def bench_steady(sup: Any, runtime: str, n: int, host: tuple[int, str]) -> str:
    """``--steady N``: where a warm LIVE turn's sealing cost lies. A sealed and a direct member
    of one sandbox, 10 warm-up turns each, then N turns each, alternated turn by turn. Each
    turn is split at its first request's arrival at its fixture (the fixture's own clock, the
    same as this process's): ``to model`` is the message sent → the request arrived, ``back``
    is that arrival → the turn settled (the answer's way back through the proxy, then the
    CLI's own finishing)."""
    user, chat = "bench", f"steady-{runtime}-{uuid.uuid4().hex[:6]}"
    await sup.model_path.open(user, chat)
    sandbox = await sup.manager.resolve(user, chat)
    pid = sandbox.container.attrs["State"]["Pid"]
    with fixture_process(DIRECT_PORT, netns_pid=pid) as direct_token:
        gateways = {"sealed": await sup.runner.gateway(runtime, user, chat, "steady-sealed"),
                    "direct": GatewayConfig(base_url=f"http://127.0.0.1:{DIRECT_PORT}", key=SecretStr(LOOPBACK_KEY),
                                            model=sup.runner.models[runtime])}
        members = {name: Member(sup, sandbox, runtime, Arm(name, gw, f"steady-{name}"))
                   for name, gw in gateways.items()}
        for m in members.values():
            await m.start(None)
            for i in range(10):
                await m.turn(f"warm-up {i}")
        times = {"sealed": lambda: host_fixture_times(*host), "direct": lambda: in_netns_times(pid, direct_token)}
        seen = {name: len(fn()) for name, fn in times.items()}
        spans: dict[str, list[tuple[float, float]]] = {"sealed": [], "direct": []}
        for i in range(n):
            for name in ("sealed", "direct") if i % 2 == 0 else ("direct", "sealed"):
                t0 = time.time()
                await members[name].turn(f"steady {i}")
                spans[name].append((t0, time.time()))
        split: dict[str, dict[str, float]] = {}
        for name, fn in times.items():
            arrivals = fn()[seen[name]:]
            to_model, back = [], []
            for t0, t1 in spans[name]:
                first = next(a for a in arrivals if t0 <= a <= t1)  # every turn asks its model
                to_model.append((first - t0) * 1000)
                back.append((t1 - first) * 1000)
            split[name] = {"turn": statistics.median((t1 - t0) * 1000 for t0, t1 in spans[name]),
                           "to model": statistics.median(to_model), "back": statistics.median(back)}
        for m in members.values():
            await m.retire()
    await sup.model_path.close(user, chat)
    return f"{runtime:9}" + "".join(
        f"{split['sealed'][k]:9.2f}{split['direct'][k]:9.2f}{split['sealed'][k] - split['direct'][k]:+8.2f}"
        for k in ("turn", "to model", "back"))


async def main(args: argparse.Namespace) -> None:
    from telemetry.logs import configure_logging

    configure_logging(json=False, level="WARNING")
    image = ensure_image()
    host_port = 18556
    results: dict[str, dict[str, Arm]] = {}
    steady: list[str] = []
    with fixture_process(host_port) as host_token, tempfile.TemporaryDirectory() as tmp:
        settings = daemon_settings(Path(tmp) / "home", f"http://127.0.0.1:{host_port}", image)
        try:
            async with running_daemon(settings, proxy_process=True) as d:
                sup = d.daemon.supervisor
                for runtime in args.runtimes.split(","):
                    if args.steady:
                        steady.append(await bench_steady(sup, runtime, args.steady, (host_port, host_token)))
                        print(steady[-1], flush=True)
                        continue
                    results[runtime] = await bench_runtime(sup, runtime, args.rounds, args.live, (host_port, host_token))
                    print(table({runtime: results[runtime]}, header=not len(results) > 1), flush=True)
        finally:
            remove_host_containers(docker.from_env(), settings.resolved_host_id())
    if args.steady:
        print(f"\nwarm LIVE turns, sealed vs direct, {args.steady} each alternated (ms, p50: sealed, direct, "
              f"difference); load {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
        print(f"{'runtime':9}" + "".join(f"{k:>26}" for k in ("turn", "to model", "back")))
        print("\n".join(steady))
        return
    print(f"\nsealed vs direct, {args.rounds} rounds per CLI (a fresh member each), LIVE = median of {args.live}; "
          f"load {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(table(results, header=True))


def table(results: dict[str, dict[str, Arm]], *, header: bool) -> str:
    lines = []
    if header:
        lines.append(f"{'runtime':9}" + "".join(f"{p + ' sealed':>16}{p + ' direct':>16}{'ratio':>7}" for p in PHASES))
    for runtime, arms in results.items():
        cells = []
        for p in PHASES:
            s, d = statistics.median(arms["sealed"].times[p]), statistics.median(arms["direct"].times[p])
            cells.append(f"{s:16.1f}{d:16.1f}{s / d:7.3f}")
        reqs = "/".join(str(statistics.median(arms[a].requests)) for a in ("sealed", "direct"))
        lines.append(f"{runtime:9}" + "".join(cells) + f"   model requests a round (sealed/direct): {reqs}")
    return "\n".join(lines)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--live", type=int, default=5)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--steady", type=int, default=0, metavar="N",
                    help="instead of the rounds: N warm LIVE turns per arm, alternated, each split at its "
                         "first request's arrival at the fixture")
    anyio.run(main, ap.parse_args())
