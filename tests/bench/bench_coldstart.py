"""OpenCode / Kilo cold start: where a NEW or RESTORED turn's seconds go (a script, not a test).

    uv run python tests/bench/bench_coldstart.py [--runtimes opencode,kilo] [--rounds 3]
                                                 [--variant NAME:K=V,K=V]... [--logs DIR]

One in-process daemon (its model proxy, its sandbox manager), one loopback fixture, the pinned
image. Per CLI and round, each variant in turn (alternating, so machine noise hits both alike):

* NEW: a fresh chat (new sandbox and state volume), the member's bridge started through the
  sandbox manager exactly as the product starts it, hello + open, one turn;
* RESTORED: the process retired, a new one started on the same home with the saved locator,
  the resume handshake, one turn.

The bridge runs with ``--trace`` (in the member's run dir): its timestamps are the container's
``CLOCK_MONOTONIC``, the host's clock (no time namespace), so they line up with this process's
``time.monotonic()``. Phases, in ms since the launch began (files written + exec):
``bridge`` (the bridge's first line of Python), ``listening`` (the server printed its port),
``sse`` (the first SSE event, ``server.connected``), ``hello``, ``opened`` (session created or
looked up), ``model`` (the first model request the fixture recorded behind the proxy),
``settled`` (the bridge's settlement line); ``sandbox`` (before the launch: resolving the chat's
sandbox, i.e. creating the volume and container for NEW) is printed apart. ``--logs DIR`` copies each run's CLI log files out.

Variants: ``before`` is the launch exactly as the product plans it; each ``--variant NAME:K=V,...``
is the same launch with those environment entries added (those with the runtime's own prefix,
``OPENCODE_`` / ``KILO_``), e.g. a CLI switch under evaluation. Each column is printed beside
``before`` with its ratio, and so is the signature of the first model request (system text, tools,
sampling keys): a switch that only saves start-up work must leave it identical.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from deploy.loopback import LoopbackFixture
from drivers.bridge import BridgeDriver
from drivers.models import Locator, Settlement
from images.build import ensure_image
from runner.processes import member_paths, start_in_sandbox
from runner.transport import exec_transport
from tests.daemon_harness import daemon_settings, running_daemon

PHASES = ("bridge", "listening", "sse", "hello", "opened", "model", "settled")
TRACE = "coldstart-trace.jsonl"


@dataclass
class Run:
    runtime: str
    variant: str
    kind: str  # NEW | RESTORED
    ms: dict[str, float] = field(default_factory=dict)
    signature: str = "-"  # request_signature of the first conversational request
    round: int = 0


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def parse_variants(specs: list[str]) -> dict[str, dict[str, str]]:
    """``before`` (the launch as the product plans it) plus each ``NAME:K=V,K=V`` experiment:
    the same launch with those environment entries added (only the runtime's own prefix)."""
    out: dict[str, dict[str, str]] = {"before": {}}
    for spec in specs:
        name, _, pairs = spec.partition(":")
        env = dict(p.split("=", 1) for p in pairs.split(",") if "=" in p)
        out[name] = env
    return out


def variant_launch(sup: Any, runtime: str, env: dict[str, str], trace: str, paths: Any, gateway: Any,
                   resume: Locator | None) -> tuple[BridgeDriver, Any]:
    driver = BridgeDriver(runtime, sup.runner.driver_options, bridge_args=("--trace", trace))
    launch = driver.plan(paths, gateway, resume)
    prefix = "OPENCODE_" if runtime == "opencode" else "KILO_"
    extra = {k: v for k, v in env.items() if k.startswith(prefix)}
    if extra:
        spec = launch.spec.model_copy(update={"env": {**launch.spec.env, **extra}})
        launch = launch.model_copy(update={"spec": spec})
    return driver, launch


def request_signature(body: Any) -> str:
    """What the model is told besides the conversation: system text, tools, sampling keys. Two
    variants that change only start-up work must send the same signature."""
    if not isinstance(body, dict):
        return "-"
    msgs = body.get("messages") or []
    system = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") == "system"]
    tools = sorted(json.dumps(t, sort_keys=True) for t in body.get("tools") or [])
    rest = {k: v for k, v in body.items() if k not in ("messages", "tools")}
    blob = json.dumps({"system": system, "tools": tools, "rest": rest, "roles": [
        m.get("role") for m in msgs if isinstance(m, dict)]}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def phases(trace_lines: list[dict[str, Any]], t0: float, model_at: float | None) -> dict[str, float]:
    """Milliseconds since ``t0`` (monotonic) of each phase, from the bridge's trace."""
    out: dict[str, float] = {}

    def at(name: str, t: float) -> None:
        out.setdefault(name, (t - t0) * 1000)

    for rec in trace_lines:
        kind, t = rec.get("kind"), rec.get("t")
        if not isinstance(t, (int, float)):
            continue
        if kind == "start":
            at("bridge", t)
        elif kind == "listening" or (kind == "rest" and rec.get("path") == "/global/health" and "status" in rec):
            at("listening", t)
        elif kind == "sse":
            at("sse", t)
        elif kind == "out":
            line = rec.get("line") or {}
            if line.get("type") in ("hello", "opened", "settled"):
                at(line["type"], t)
    if model_at is not None:
        out["model"] = (model_at - t0) * 1000
    return out


async def one_start(d: Any, fx: Any, runtime: str, variant: str, env: dict[str, str], user: str, chat: str,
                    member: str,
                    resume: Locator | None, logs: Path | None, kind: str) -> tuple[Run, Locator]:
    sup = d.daemon.supervisor
    t_sb = time.monotonic()
    sandbox = await sup.runner.resolve_sandbox(user, chat)
    sandbox_ms = (time.monotonic() - t_sb) * 1000
    dirs = sup.manager.member_dirs(member)
    trace = f"{dirs.run_dir}/{TRACE}"
    await sup.manager.engine.exec_run(sandbox.container_id, ["rm", "-f", trace])
    gateway = await sup.runner.gateway(runtime, user, chat, member)
    driver, launch = variant_launch(sup, runtime, env, trace, member_paths(dirs), gateway, resume)
    since = fx.requests()[-1].seq if fx.requests() else 0
    wall_minus_mono = time.time() - time.monotonic()
    t0 = time.monotonic()
    proc = await start_in_sandbox(sup.manager, sandbox, dirs, launch, name="bench")
    session = driver.session(exec_transport(proc.stream), launch)
    try:
        with anyio.fail_after(300):
            await session.handshake()
            out = await session.run_turn(f"cold start probe {uuid.uuid4().hex[:6]}", emit=lambda ev: None,
                                         timeout_s=300)
        t_end = time.monotonic()
        assert isinstance(out, Settlement) and not out.is_error and out.observed_locator, out
        locator = out.observed_locator
    finally:
        await session.close(3.0)
        await sup.manager.kill_group(proc.container_id, proc.pidfile)
    reqs = [r for r in fx.requests(since=since) if r.kind == "conversation"]
    model_at = reqs[0].time - wall_minus_mono if reqs else None
    signature = request_signature(reqs[0].body) if reqs else "-"
    _, raw = await sup.manager.engine.exec_run(sandbox.container_id, ["cat", trace])
    lines = [json.loads(x) for x in raw.decode(errors="replace").splitlines() if x.strip().startswith("{")]
    run = Run(runtime, variant, kind, phases(lines, t0, model_at), signature=signature)
    run.ms["total"] = (t_end - t0) * 1000
    run.ms["sandbox"] = sandbox_ms
    if logs is not None:
        name = "opencode" if runtime == "opencode" else "kilo"
        _, raw = await sup.manager.engine.exec_run(
            sandbox.container_id, ["sh", "-c", f'cat "{dirs.home}"/.local/share/{name}/log/*.log 2>/dev/null'])
        logs.mkdir(parents=True, exist_ok=True)
        (logs / f"{runtime}-{variant}-{kind}-{chat}.log").write_bytes(raw)
        (logs / f"{runtime}-{variant}-{kind}-{chat}.trace.jsonl").write_text(
            "\n".join(json.dumps(x) for x in lines) + "\n")
    return run, locator


async def bench(args: argparse.Namespace, variants: dict[str, dict[str, str]]) -> list[Run]:
    from telemetry.logs import configure_logging

    configure_logging(json=False, level="WARNING")
    image = ensure_image()
    runs: list[Run] = []
    logs = Path(args.logs) if args.logs else None
    with LoopbackFixture.start() as fx, tempfile.TemporaryDirectory() as tmp:
        settings = daemon_settings(Path(tmp) / "home", fx.base_url, image)
        async with running_daemon(settings, proxy_process=True) as d:
            user = "bench"
            chats: list[str] = []
            try:
                for rnd in range(args.rounds):
                    for runtime in args.runtimes.split(","):
                        order = list(variants)
                        if rnd % 2:
                            order.reverse()
                        for variant in order:
                            env = variants[variant]
                            chat = f"cold-{runtime}-{variant}-{uuid.uuid4().hex[:6]}"
                            chats.append(chat)
                            new, loc = await one_start(d, fx, runtime, variant, env, user, chat, "m1", None, logs,
                                                       "NEW")
                            restored, _ = await one_start(d, fx, runtime, variant, env, user, chat, "m1", loc, logs,
                                                          "RESTORED")
                            new.round = restored.round = rnd
                            runs += [new, restored]
                            print(f"  round {rnd} {runtime:8} {variant:10} NEW {new.ms['total']:7.0f} ms  "
                                  f"RESTORED {restored.ms['total']:7.0f} ms  request {new.signature} "
                                  f"(load {load()})", flush=True)
            finally:
                for chat in chats:
                    await d.client.delete(f"/v1/users/{user}/chats/{chat}")
    return runs


def report(runs: list[Run], variants: list[str]) -> None:
    print(f"\ncold start: median ms since the launch began (files + exec), per phase; load {load()}")
    for runtime in dict.fromkeys(r.runtime for r in runs):
        for kind in ("NEW", "RESTORED"):
            print(f"\n== {runtime} {kind}")
            print(f"  {'phase':10}" + "".join(f"{v:>12}" for v in variants)
                  + "".join(f"{v + '/before':>16}" for v in variants[1:]))
            for phase in ("sandbox", *PHASES, "total"):
                meds = []
                for v in variants:
                    xs = [r.ms[phase] for r in runs if (r.runtime, r.kind, r.variant) == (runtime, kind, v)
                          and phase in r.ms]
                    meds.append(statistics.median(xs) if xs else None)
                cells = "".join(f"{m:12.0f}" if m is not None else f"{'-':>12}" for m in meds)
                ratios = "".join(f"{m / meds[0]:16.2f}" if m is not None and meds[0] else f"{'-':>16}"
                                 for m in meds[1:])
                print(f"  {phase:10}{cells}{ratios}")
            # The system text carries the date: compare the variants of one round with each other.
            rows = [r for r in runs if (r.runtime, r.kind) == (runtime, kind)]
            same = all(len({r.signature for r in rows if r.round == rnd}) == 1 for rnd in {r.round for r in rows})
            n = min(sum(1 for r in rows if r.variant == v) for v in variants)
            print(f"  (n={n} per variant; first model request signature per round "
                  f"{'identical across variants' if same else 'DIFFERS between variants'}: "
                  f"{sorted({(r.round, r.variant, r.signature) for r in rows})})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtimes", default="opencode,kilo")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME:K=V,K=V",
                    help="an experiment beside 'before': the same launch plus these environment entries")
    ap.add_argument("--logs", help="copy each run's CLI log and bridge trace into this directory")
    args = ap.parse_args()
    variants = parse_variants(args.variant)
    runs = anyio.run(bench, args, variants)
    report(runs, list(variants))


if __name__ == "__main__":
    main()
