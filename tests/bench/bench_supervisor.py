"""Supervisor overhead for all five CLIs, measured side by side in one run (issue 16).

    uv run python tests/bench/bench_supervisor.py [N] [--runtimes claude,codex,pi,opencode,kilo]
                                                  [--chats 16] [--rounds 3] [--restored 3] [--keeper-arm]
                                                  [--loop uvloop|asyncio] [--quiet-s S] [--instances K]

One in-process daemon (uvicorn in this process), its API client in a process of its own
(tests/bench/api_client.py, as a host's clients are; ``--client lean`` swaps httpx for the
leanest HTTP/1.1 client, ``--client inline`` puts it on the
daemon's loop as before), one loopback fixture in a process of its own (as `cloud-agent serve`
runs it; ``--fixture-in-process`` for this process's threads, as before), the pinned image. Per CLI:

1. LIVE: N turns through the daemon's job API (POST → receipt line) against N turns of a
   **bare** session: the same driver on its own attached exec in the same container, called
   directly (no API, admission, locks, integrity checks, store, receipt). The difference is
   the supervisor's whole per-turn overhead; p50 and p99 of the added milliseconds.
2. RESTORED after a stop (``--restored`` turns per arm, 3 by default): daemon (stop route,
   then a job) ÷ bare (engine start, gate ready, exec, resume handshake, turn), and where each
   arm's time goes.
3. First event latency: the CLI's stdout line as the transport reads it → the API client's
   NDJSON line of the event it became (p50).
4. Throughput: ``--chats`` chats × ``--rounds`` LIVE turns dispatched concurrently through the
   daemon ÷ the same number of bare sessions (one per chat container) driven concurrently;
   with ``--tp-blocks K``, K pairs of such blocks, alternated, both arms' sessions alive at once.

Once: sandbox create+start (SandboxManager.resolve of a new chat) ÷ raw SDK create+start of a bare
container, and ÷ the engine calls that make the same sandbox (volume, container spec, start).
With bench mode available (``TestHooks.turn_trace``) it also prints the median per-phase
breakdown of the daemon's LIVE turns. The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import inspect
import math
import os
import random
import sqlite3
import statistics
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import closing, contextmanager, nullcontext
from dataclasses import fields
from pathlib import Path
from typing import Any

import anyio
import docker

from deploy.loopback import LoopbackFixture
from drivers.models import Locator
from drivers.transport import Transport, TransportWrapper
from images.build import ensure_image
from runner import event_loop, heap
from runner.loopback_child import loopback_child
from runner.processes import member_paths, start_in_sandbox
from runner.transport import exec_transport
from runner.turn import TestHooks
from telemetry.turn_trace import mark
from tests.bench.api_client import RemoteClient
from tests.bench.sched_trace import (
    SchedTrace,
    attribute,
    preemption_report,
    preemptions,
    report,
)
from tests.daemon_harness import TOKEN, daemon_settings, running_daemon
from tests.support.store import rows

RUNTIMES = ("claude", "codex", "pi", "opencode", "kilo")
TRACING = "turn_trace" in {f.name for f in fields(TestHooks)}


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


# Both throughput arms start timing this long after their 16 CLIs started: a CLI's first seconds
# (its own start-up work, the budget's first reading) must not land on one arm only.
SETTLE_S = 5.0


def _label(pid: str) -> str:
    """A process by what it runs: the script or module for Python, else the command's name."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return "kernel"
    name = Path(words[0]).name
    if name.startswith("python"):
        rest = [w for w in words[1:] if not w.startswith("-")]
        return f"python {Path(rest[0]).name if rest else ''}".strip()
    if name == "node" and len(words) > 1:
        return f"node {Path(words[1]).name}"
    return name


def _cpu_busy_idle() -> tuple[int, int]:
    """The host's CPU ticks so far: busy, and idle with iowait."""
    cpu = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(cpu) - cpu[3] - cpu[4], cpu[3] + cpu[4]


def cpu_by_process() -> dict[str, float]:
    """CPU seconds used so far by every live process, summed by :func:`_label`, and ``all``
    (the machine's busy time, /proc/stat)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        label = _label(pid)
        out[label] = out.get(label, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        # children that ended (and were waited for): their CPU, under their parent's label
        out[f"{label} (children)"] = out.get(f"{label} (children)", 0.0) + (int(fields[13]) + int(fields[14])) / tick
    for tid in os.listdir("/proc/self/task"):  # this process's threads: the loop's and the workers'
        try:
            fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        key = "  its loop thread" if tid == str(os.getpid()) else "  its other threads"
        out[key] = out.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / tick
        if key == "  its loop thread":
            try:  # the time it was runnable and waited for a core (schedstat: on-CPU, waiting, slices)
                out[LOOP_WAIT] = int(Path(f"/proc/self/task/{tid}/schedstat").read_text().split()[1]) / 1e9
            except (OSError, IndexError, ValueError):
                pass
    out[GC_KEY] = GC_CLOCK.seconds
    busy, idle = _cpu_busy_idle()
    out["all"] = busy / tick
    out[IDLE] = idle / tick
    forks = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("processes "))
    out[FORKS] = float(forks.split()[1])
    return out


FORKS = "processes started"  # a count, not CPU seconds: reported per turn as it is
IDLE = "idle (the host's CPUs, iowait too)"  # time no process could use: a wait, not work
GC_KEY = "  this process's garbage collector"  # this process's collections (within its threads' CPU)
# the loop thread's time runnable but off a core (another task ran): a wait, not work; under many
# chats it lengthens every event the loop serves, and each chat waits on the loop
LOOP_WAIT = "  its loop thread, runnable, waiting for a core"


class GcClock:
    """The time this process spent in the cyclic garbage collector (a collection holds the GIL
    from its start callback to its stop callback): the daemon's and the bare arm's drivers'
    collections, side by side in the CPU table."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.thread_time()
        else:
            self.seconds += time.thread_time() - self._started


GC_CLOCK = GcClock()


async def quiet_host(max_s: float, busy_below: float = 0.10, window_s: float = 0.05) -> None:
    """Wait (at most ``max_s``) until the host's CPUs were under ``busy_below`` busy for a
    ``window_s`` window. OpenCode and Kilo go on working for a while after a turn, and both
    arms' CLIs share one container: without this their after-turn work lands on the other
    arm's next turn (``--quiet-s``)."""
    deadline = time.monotonic() + max_s
    while time.monotonic() < deadline:
        b0, i0 = _cpu_busy_idle()
        await anyio.sleep(window_s)
        b1, i1 = _cpu_busy_idle()
        if (b1 - b0) < busy_below * max(1, (b1 - b0) + (i1 - i0)):
            return


# The processes between the API and the CLI in either arm: the daemon (or the bare arm's driver,
# in this process too), the keeper, the API client, the proxy service and the WAL flusher; the
# engine and the shim the bare arm's exec goes through. The CLI and the model fixture are the
# same work in both arms.
WAY = ("python bench_supervisor.py", "python ca-keeper", "python api_client.py", "python runner.proxy_service",
       "python wal_flush_child.py", "dockerd", "containerd", "containerd-shim-runc-v2")
WAY_KEY = "the way to the CLI"


def cpu_per_turn(before: dict[str, float], after: dict[str, float], turns: int) -> dict[str, float]:
    """CPU ms per turn by process label (labels that used at least 0.5 ms per turn); processes
    that ended meanwhile are not counted, ``all`` counts everything, :data:`WAY_KEY` the
    :data:`WAY` processes' (the small ones too)."""
    out = {k: (after[k] - before.get(k, 0.0)) * (1 if k == FORKS else 1000) / turns for k in after}
    way = sum(v for k, v in out.items() if k.removesuffix(" (children)") in WAY)
    kept = dict(sorted(((k, v) for k, v in out.items() if v >= 0.5 or k in (FORKS, GC_KEY, IDLE, LOOP_WAIT)), key=lambda kv: -kv[1]))
    return {**kept, WAY_KEY: way}


def way_line(runtime: str, d: dict[str, float], b: dict[str, float]) -> str:
    """What the ratio of two CPU-bound arms is made of: the way to the CLI in each, everything
    else (the CLI, the fixture: the same work, but another process set in each arm), and the
    CPU a turn the daemon arm could spend for a ratio of 0.90."""
    rest_d, rest_b = d["all"] - d[WAY_KEY], b["all"] - b[WAY_KEY]
    return (f"{runtime}: CPU ms a turn under the throughput run, the way to the CLI (daemon, keeper, client, proxy "
            f"service, WAL flusher | this process's driver, dockerd, containerd, the shim): {d[WAY_KEY]:.1f} | "
            f"{b[WAY_KEY]:.1f}, the supervisor's share {d[WAY_KEY] - b[WAY_KEY]:+.1f}; everything else "
            f"(the CLI, the fixture) {rest_d:.1f} | {rest_b:.1f}; 0.90 of the bare arm's turns a second "
            f"allows {b['all'] / 0.9:.1f} ms a turn, {b['all'] / 0.9 - b['all']:.1f} over its {b['all']:.1f}")


def table_order(keys: list[str], by: dict[str, float]) -> list[str]:
    """Processes by CPU (``by``), largest first, each of this process's threads' rows (indented)
    right under this process's own."""
    ours = sorted((k for k in keys if k.startswith("  ")), key=lambda k: -by.get(k, 0.0))
    out: list[str] = []
    for k in sorted((k for k in keys if not k.startswith("  ")), key=lambda k: -by.get(k, 0.0)):
        out.append(k)
        if k == "python bench_supervisor.py":
            out += ours
    return out if "python bench_supervisor.py" in keys else out + ours


def load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


class Stamps:
    """perf_counter_ns of every CLI stdout line the daemon's transports read (bench only)."""

    def __init__(self) -> None:
        self.lines: list[int] = []

    def wrap(self, transport: Transport, runtime: str) -> Transport:
        stamps = self

        class Stamped(TransportWrapper):
            async def send(self, line: bytes) -> None:
                await self.inner.send(line)
                mark("input_sent")  # in a traced job's task: the CLI's input is on its way

            async def receive(self) -> bytes | None:
                line = await self.inner.receive()
                stamps.lines.append(time.perf_counter_ns())
                return line

        return Stamped(transport)

    def before(self, t: int) -> int | None:
        """The last line read at or before ``t`` (the one an event at ``t`` came from)."""
        best = None
        for s in reversed(self.lines):
            if s <= t:
                best = s
                break
        return best


class Bare:
    """The same driver on its own exec in the chat's container, no supervisor in between."""

    def __init__(self, sup: Any, user: str, chat: str, runtime: str, member: str = "bare", via: str = "exec") -> None:
        self.sup, self.user, self.chat, self.runtime, self.member = sup, user, chat, runtime, member
        self.via = via  # "keeper": the CLI under a keeper, as the daemon runs it (--keeper-arm)
        self.driver = sup.runner.driver(runtime)
        self.dirs = sup.manager.member_dirs(member)
        self.session: Any = None
        self.locator: Locator | None = None
        self.keeper: Any = None

    async def start(self, sandbox: Any, resume: Locator | None = None) -> None:
        gateway = self.sup.runner.gateway(self.runtime, self.user, self.chat, self.member)
        if inspect.isawaitable(gateway):  # async since the proxy service (a bench of an older commit runs too)
            gateway = await gateway
        launch = self.driver.plan(member_paths(self.dirs), gateway, resume)
        if self.via == "keeper":
            self.keeper = await self.sup.runner.keepers.start(sandbox, self.dirs, launch, self.member)
            stream = self.keeper.channel
        else:
            stream = (await start_in_sandbox(self.sup.manager, sandbox, self.dirs, launch, name="bare")).stream
        self.attached_ns = time.perf_counter_ns()  # the RESTORED breakdown's bare `attached`
        self.session = self.driver.session(exec_transport(stream), launch)
        await self.session.handshake()

    async def turn(self, message: str) -> None:
        out = await self.session.run_turn(message, emit=lambda ev: None, timeout_s=300)
        assert not getattr(out, "is_error", True) and getattr(out, "observed_locator", None), out
        self.locator = out.observed_locator
        self.session.locator = out.observed_locator

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close(3.0)
            await self.session.transport.close()
        if self.keeper is not None:
            await self.sup.runner.keepers.kill(self.keeper.container_id, self.keeper.run_dir)
            self.keeper = None


async def timed_job(d: Any, job: dict[str, Any]) -> tuple[float, dict[str, Any] | None, int | None, int]:
    """(wall ms, receipt, perf_counter_ns when the client read the first event line, t0).
    With ``d.remote`` (the default) the client is a process of its own (tests/bench/api_client.py)."""
    import json

    remote = getattr(d, "remote", None)
    if remote is not None:
        r = await remote.job(job)
        return (r["end"] - r["t0"]) / 1e6, r["receipt"], r["first"], r["t0"]
    t0 = time.perf_counter_ns()
    first = None
    receipt = None
    async with d.client.stream("POST", "/v1/jobs", json=job) as resp:
        async for line in resp.aiter_lines():
            if not line.strip():
                continue
            if first is None and line.startswith('{"type": "event"'):
                first = time.perf_counter_ns()
            ev = json.loads(line)
            if ev.get("type") == "receipt":
                receipt = ev["receipt"]
    return (time.perf_counter_ns() - t0) / 1e6, receipt, first, t0


def phase_row(trace: Any, t0: int, ms: float) -> list[tuple[str, float]]:
    """A traced job's phases: the request's way in, each mark's span, the receipt's way out.
    A phase marked again in the same turn is numbered (``input_sent 2``: a handshake's second
    request), so its median is not mixed with the first's."""
    seen: Counter[str] = Counter()
    spans = []
    for name, span in trace.spans_ms():
        seen[name] += 1
        spans.append((name if seen[name] == 1 else f"{name} {seen[name]}", span))
    return ([("http_in", (trace.marks[0][1] - t0) / 1e6)] + spans
            + [("client_got_receipt", ms - (trace.marks[-1][1] - t0) / 1e6)])


class EngineCalls:
    """The daemon's engine calls while :meth:`counting` is entered, by the SDK function's name."""

    def __init__(self, sup: Any) -> None:
        self.engine, self._real = sup.manager.engine, sup.manager.engine._call
        self.names: list[str] = []

    async def _counted(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        self.names.append(getattr(fn, "__qualname__", repr(fn)).split(".<locals>")[0])
        return await self._real(fn, *args, **kwargs)

    @contextmanager
    def counting(self) -> Iterator[None]:
        self.engine._call = self._counted
        try:
            yield
        finally:
            self.engine._call = self._real

    def per_turn(self, turns: int) -> dict[str, float]:
        return {k: v / turns for k, v in sorted(Counter(self.names).items())}


MEM_SPARE = 0.25  # of the host's memory, left free with both throughput arms' sessions alive at once


def _meminfo(key: str) -> int:
    line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith(f"{key}:"))
    return int(line.split()[1]) * 1024


def mem_available() -> int:
    return _meminfo("MemAvailable")


def mem_total() -> int:
    return _meminfo("MemTotal")


async def alternated_blocks(out: dict[str, Any], sup: Any, conc: list[str], bares: list[Bare],
                            warm_bare: Callable[[str], Any], daemon_turn: Callable[[str, int], Any],
                            bare_turn: Callable[[Bare, int], Any], blocks: int, block_s: float) -> None:
    """``--tp-blocks``: the bare sessions start beside the daemon's residents (same containers,
    member ``bare``), then the arms take turns, block by block: in pairs, daemon then bare, bare
    then daemon, and so on (a drift of the host's speed over a pair counts against each arm
    alike). One block each, as without it, leaves each arm to its own moment of the host, whose
    speed moves by up to 2x in minutes: seven runs of the same tree gave ratios of 0.67-1.02.

    A block is a window of ``block_s`` seconds in which every chat takes turn after turn: its
    throughput is the turns that ended in the window, and its CPU the window's. A fixed number
    of turns a chat instead ends with a tail where fewer chats than cores still run, which a
    host's steady load never has. (The tail is not where the daemon's blocks idle, though: Pi,
    16 chats, the host's CPUs idled 1.2 ms a turn in the daemon's blocks of 4 turns a chat
    against 0.2 in the bare ones, and 1.6 against 0.4 in windows; iowait ~0.) Each pair's
    ratio is printed too."""
    async with anyio.create_task_group() as tg:
        for c in conc:
            tg.start_soon(warm_bare, c)
    await anyio.sleep(SETTLE_S)
    spent: dict[str, dict[str, float]] = {"d": {}, "b": {}}
    seconds = {"d": 0.0, "b": 0.0}
    turns = {"d": 0, "b": 0}
    pairs: list[float] = []
    engine_calls = EngineCalls(sup)
    # BENCH_SCHED_TRACE=1: who ran while a CPU idled, from the kernel's context switches (a
    # directory instead of 1: the trace and its windows are kept there)
    where = os.environ.get("BENCH_SCHED_TRACE", "")
    trace = SchedTrace(_label, None if where == "1" else Path(where)) if where else None
    if trace is not None and (why := SchedTrace.available()):
        print(f"no scheduler trace: {why}", flush=True)
        trace = None

    async def window(arm: str) -> tuple[int, float, dict[str, float]]:
        ended = 0
        cpu_end: dict[str, float] = {}
        t = time.perf_counter()
        deadline = t + block_s
        cpu0 = cpu_by_process()

        async def chat(one: Any) -> None:
            nonlocal ended, cpu_end
            k = 0
            while time.perf_counter() < deadline:
                ok = await (daemon_turn(one, k) if arm == "d" else bare_turn(one, k))
                k += 1
                if time.perf_counter() <= deadline:
                    ended += ok
                elif not cpu_end:  # the first turn past the window: the window's CPU ends here
                    cpu_end = cpu_by_process()

        async with anyio.create_task_group() as tg:
            for one in conc if arm == "d" else bares:
                tg.start_soon(chat, one)
        if trace is not None:
            trace.window(arm, t, deadline)
        return ended, block_s, {k: v - cpu0.get(k, 0.0) for k, v in (cpu_end or cpu_by_process()).items()}

    if trace is not None:
        trace.start()
        await anyio.sleep(0.5)  # perf's start-up work is not the first window's
    print(f"throughput: {blocks} pairs of {block_s:g} s windows, {len(conc)} chats (pid {os.getpid()})", flush=True)
    for i in range(blocks):
        rate: dict[str, float] = {}
        for arm in ("d", "b") if i % 2 == 0 else ("b", "d"):
            await quiet_host(SETTLE_S)  # the last block's after-turn work (OpenCode, Kilo) is not this one's
            with engine_calls.counting() if arm == "d" else nullcontext():
                n, took, cpu = await window(arm)
            for k, v in cpu.items():
                spent[arm][k] = spent[arm].get(k, 0.0) + v
            seconds[arm] += took
            turns[arm] += n
            rate[arm] = n / took
            if not n:  # every chat's turn outlasted the window (Kilo, OpenCode under 16 chats: 3-6 s)
                print(f"no turn ended in a {block_s:g} s window of the {'daemon' if arm == 'd' else 'bare'} arm: "
                      "its turns take longer; a longer --tp-block-s measures it", flush=True)
        pairs.append(rate["d"] / rate["b"] if rate["b"] else math.nan)
    out["tp_d"], out["tp_b"] = turns["d"] / seconds["d"], turns["b"] / seconds["b"]
    out["cpu_d"] = cpu_per_turn({}, spent["d"], max(1, turns["d"]))
    out["cpu_b"] = cpu_per_turn({}, spent["b"], max(1, turns["b"]))
    out["tp_pairs"] = pairs
    if trace is not None:
        switches = await anyio.to_thread.run_sync(trace.stop)
        group = trace.group_of(os.getpid())
        shares = attribute(switches, trace.windows, os.cpu_count() or 1, group)
        out["sched_idle"] = report(shares, turns) + [
            f"  ({len(switches)} switches; wall s traced {'|'.join(f'{shares[a].seconds:.1f}' for a in ('d', 'b'))})",
            *preemption_report(preemptions(switches, trace.windows, os.getpid(), group), turns)]
    out["tp_window_s"] = block_s
    out["engine_calls"] = engine_calls.per_turn(max(1, turns["d"]))


async def mixed_window(d: Any, job: Callable[..., dict[str, Any]], conc: list[str], bares: list[Bare], runtime: str,
                       warm_turns: int, seconds: float, failures: list[str]) -> tuple[int, int]:
    """Half the chats through the daemon and the other half's bare sessions, all at once for
    ``seconds``: the turns each arm completed in the same window. The throughput run's arms run
    one after the other, and this host's speed moves between them (the same tree's ratio moved
    from 0.63 to 1.07 in one afternoon); here both arms share every moment, and compete."""
    half = len(conc) // 2
    through_daemon = conc[:half]
    bare_half = [b for b in bares if b.chat not in through_daemon][:half]

    async def warm(c: str) -> None:  # its resident was retired for the bare arm: launched again
        for k in range(warm_turns):
            await timed_job(d, job(f"mixed warm {k}", c=c))

    async with anyio.create_task_group() as tg:
        for c in through_daemon:
            tg.start_soon(warm, c)
    await anyio.sleep(SETTLE_S)
    done = {"daemon": 0, "bare": 0}
    deadline = time.perf_counter() + seconds

    async def daemon_chat(c: str) -> None:
        k = 0
        while time.perf_counter() < deadline:
            _, r, _, _ = await timed_job(d, job(f"mixed {k}", c=c))
            k += 1
            if not r or r["outcome"] != "succeeded" or r["context_status"] != "LIVE":
                failures.append(f"mixed {r and r.get('context_status')} {r and r.get('reason')}")
                continue
            done["daemon"] += 1

    async def bare_chat(b: Bare) -> None:
        k = 0
        while time.perf_counter() < deadline:
            await b.turn(f"mixed {k}")
            k += 1
            done["bare"] += 1

    async with anyio.create_task_group() as tg:
        for c in through_daemon:
            tg.start_soon(daemon_chat, c)
        for b in bare_half:
            tg.start_soon(bare_chat, b)
    print(f"{runtime}: {half} chats through the daemon and {len(bare_half)} bare, at once for {seconds:g} s: "
          f"{done['daemon']} and {done['bare']} turns, ratio {done['daemon'] / max(1, done['bare']):.3f}", flush=True)
    return done["daemon"], done["bare"]


async def bench_runtime(d: Any, runtime: str, n: int, chats: int, rounds: int, stamps: Stamps,
                        traces: dict[str, Any], keeper_arm: bool = False, restored: int = 3,
                        warm_turns: int = 1, quiet_s: float = 0.0, instances: int = 1,
                        mixed_s: float = 0.0, tp_blocks: int = 1, tp_block_s: float = 5.0) -> dict[str, Any]:
    sup = d.daemon.supervisor
    user, chat = "bench", f"{runtime}-{uuid.uuid4().hex[:6]}"

    def job(msg: str, c: str = chat, m: str = "m1") -> dict[str, Any]:
        return {"job_id": uuid.uuid4().hex, "user_id": user, "chat_id": c, "member_id": m,
                "runtime": runtime, "message": msg}

    out: dict[str, Any] = {"load": {}}
    # `instances` CLI processes per arm, taken in turn: one OpenCode or Kilo process does ~10 ms
    # more or less of its own work a turn than another in the same container, so with one per
    # arm that difference lands in "added"; spread over several, it averages out
    members = [f"m{k + 1}" for k in range(instances)]
    for m in members:
        _, r, _, _ = await timed_job(d, job("warm up", m=m))
        assert r and r["outcome"] == "succeeded", r
        _, r, _, _ = await timed_job(d, job("warm up live", m=m))
        assert r and r["context_status"] == "LIVE", r
    sb = await sup.manager.resolve(user, chat)
    bares_live: list[Bare] = []
    kbares: list[Bare] = []
    for k in range(instances):
        tag = "" if instances == 1 else str(k + 1)
        bares_live.append(Bare(sup, user, chat, runtime, member=f"bare{tag}"))
        if keeper_arm:
            kbares.append(Bare(sup, user, chat, runtime, member=f"bare-keeper{tag}", via="keeper"))
    for b in bares_live + kbares:
        await b.start(sb)
        await b.turn("bare warm up")
        await b.turn("bare warm up live")
    bare = bares_live[0]  # RESTORED's bare arm
    # ---- LIVE, alternating daemon / bare so machine noise hits both alike
    live_d, live_b, live_k, first_ev, phase_rows = [], [], [], [], []
    cpu_live: dict[str, dict[str, float]] = {"d": {}, "b": {}, "k": {}}  # CPU per arm, one turn at a time

    def count_cpu(arm: str, before: dict[str, float]) -> None:
        for k, v in cpu_by_process().items():
            if k not in (FORKS, IDLE):
                cpu_live[arm][k] = cpu_live[arm].get(k, 0.0) + (v - before.get(k, 0.0)) * 1000 / n

    for i in range(n):
        if quiet_s:
            await quiet_host(quiet_s)
        cpu0 = cpu_by_process()
        ms, r, first, t0 = await timed_job(d, job(f"live {i}", m=members[i % instances]))
        count_cpu("d", cpu0)
        assert r and r["context_status"] == "LIVE" and r["outcome"] == "succeeded", r
        live_d.append(ms)
        trace = traces.get(r["job_id"])
        if trace is not None:
            marks = dict(trace.marks)
            if first is not None and "first_event" in marks:
                line = stamps.before(marks["first_event"])
                if line is not None:
                    first_ev.append((first - line) / 1e6)
            phase_rows.append(phase_row(trace, t0, ms))
        if quiet_s:
            await quiet_host(quiet_s)
        cpu0 = cpu_by_process()
        t = time.perf_counter_ns()
        await bares_live[i % instances].turn(f"bare live {i}")
        live_b.append((time.perf_counter_ns() - t) / 1e6)
        count_cpu("b", cpu0)
        if kbares:
            if quiet_s:
                await quiet_host(quiet_s)
            cpu0 = cpu_by_process()
            t = time.perf_counter_ns()
            await kbares[i % instances].turn(f"keeper live {i}")
            live_k.append((time.perf_counter_ns() - t) / 1e6)
            count_cpu("k", cpu0)
    out["load"]["live"] = load()
    print(f"{runtime}: {ledger_bytes(sup.settings.store_path, user, chat, members)}", flush=True)
    if instances > 1:  # each instance's own medians: how far one CLI process differs from another
        for k in range(instances):
            dk, bk = live_d[k::instances], live_b[k::instances]
            print(f"{runtime}: instance {k + 1}: daemon {statistics.median(dk):.1f} ms, bare "
                  f"{statistics.median(bk):.1f} ms over {len(dk)} turns each", flush=True)
    for b in bares_live[1:] + kbares:
        await b.close()
    if kbares:
        k, b, dd = statistics.median(live_k), statistics.median(live_b), statistics.median(live_d)
        print(f"{runtime}: LIVE p50 daemon {dd:.1f} ms, bare under a keeper {k:.1f} ms, bare exec {b:.1f} ms: "
              f"the keeper hop {k - b:+.1f} ms, the rest of the supervisor {dd - k:+.1f} ms", flush=True)
        ck, cb = cpu_live["k"], cpu_live["b"]
        print(f"{runtime}: CPU ms per LIVE turn, bare under a keeper | bare exec", flush=True)
        for name in sorted((x for x in set(ck) | set(cb) if max(ck.get(x, 0.0), cb.get(x, 0.0)) >= 0.5),
                           key=lambda x: -ck.get(x, 0.0)):
            print(f"  {name:36} {ck.get(name, 0.0):8.1f} {cb.get(name, 0.0):8.1f}", flush=True)
    out["live_d"], out["live_b"], out["first"], out["phases"] = live_d, live_b, first_ev, phase_rows
    out["instances"] = instances
    out["cpu_live_d"], out["cpu_live_b"] = cpu_live["d"], cpu_live["b"]
    # ---- RESTORED after a stop
    rest_d, rest_b, rest_phases, rest_bare = [], [], [], []
    cid = sb.container_id
    for i in range(restored):
        await bare.close()
        await d.client.post(f"/v1/users/{user}/chats/{chat}/stop")
        ms, r, _, t0 = await timed_job(d, job(f"restored {i}"))
        assert r and r["context_status"] == "RESTORED" and r["outcome"] == "succeeded", r
        rest_d.append(ms)
        if (trace := traces.get(r["job_id"])) is not None:
            rest_phases.append(phase_row(trace, t0, ms))
        # bare: the same stop, then start + gate + exec + resume + turn with nothing in between
        await sup.pool.retire((user, chat, "m1"), "bench")
        await sup.manager.engine.stop(cid)
        t = time.perf_counter_ns()
        since = time.time()
        await sup.manager.engine.start(cid)
        t_started = time.perf_counter_ns()
        await sup.manager.gate_ready(await sup.manager.engine.inspect(cid), since)
        t_gate = time.perf_counter_ns()
        await bare.start(sb, resume=bare.locator)  # the same container: its Sandbox still names it
        t_ready = time.perf_counter_ns()
        await bare.turn(f"bare restored {i}")
        t_end = time.perf_counter_ns()
        rest_b.append((t_end - t) / 1e6)
        rest_bare.append([("engine_start", (t_started - t) / 1e6), ("gate_ready", (t_gate - t_started) / 1e6),
                          ("attached", (bare.attached_ns - t_gate) / 1e6),
                          ("handshake", (t_ready - bare.attached_ns) / 1e6), ("turn", (t_end - t_ready) / 1e6)])
    await bare.close()
    out["load"]["restored"] = load()
    out["rest_d"], out["rest_b"], out["rest_phases"], out["rest_bare"] = rest_d, rest_b, rest_phases, rest_bare
    # The one-at-a-time chat is done with (its bare session closed above): its resident goes
    # too, so the throughput arms hold the same `chats` sessions each. Left running, it made 17
    # Kilo residents of 720 MiB each, over the default memory budget (half of 24 GiB), and the
    # daemon retired idle ones as it must: RESTORED turns counted as failures of the run.
    await d.client.post(f"/v1/users/{user}/chats/{chat}/stop")
    if not chats:  # `--chats 0`: the one-at-a-time figures alone
        out.update(tp_d=0.0, tp_b=0.0, failures=[], tp_phases=[], tp_lat_d=[], tp_lat_b=[])
        out["load"]["throughput"] = "-"
        return out
    # ---- throughput: chats × rounds LIVE turns, daemon vs bare, concurrently
    conc = [f"{runtime}-c{i}-{uuid.uuid4().hex[:4]}" for i in range(chats)]
    failures: list[str] = []
    bares: list[Bare] = []

    async def warm(c: str) -> None:
        for k in range(warm_turns):
            _, r, _, _ = await timed_job(d, job(f"warm {k}", c=c))
            if not r or r["outcome"] != "succeeded":
                failures.append(f"warm {r and r.get('reason')}")

    available_before = mem_available()
    async with anyio.create_task_group() as tg:
        for c in conc:
            tg.start_soon(warm, c)
    # what the chats' sandboxes and residents took: as much again for the bare sessions
    sessions_took = available_before - mem_available()

    tp_rows: list[list[tuple[str, float]]] = []
    tp_lat_d: list[float] = []
    tp_lat_b: list[float] = []

    async def daemon_turn(c: str, k: int) -> bool:
        ms, r, _, t0 = await timed_job(d, job(f"conc {k}", c=c))
        if not r or r["outcome"] != "succeeded" or r["context_status"] != "LIVE":
            failures.append(f"{r and r.get('context_status')} {r and r.get('reason')}")
            return False
        tp_lat_d.append(ms)
        trace = traces.get(r["job_id"])
        if trace is not None:
            tp_rows.append(phase_row(trace, t0, ms))
        return True

    async def daemon_chat(c: str) -> None:
        for k in range(rounds):
            await daemon_turn(c, k)

    # The bare sessions start two at a time once the daemon's residents are gone: their start is
    # not measured, and 16 Kilo or OpenCode servers starting at once beside 16 residents overload
    # a 2-core host (the bridge's event stream misses its deadline) and its memory.
    starting = anyio.CapacityLimiter(2)

    async def warm_bare(c: str) -> None:
        async with starting:
            b = Bare(sup, user, c, runtime)
            await b.start(await sup.manager.resolve(user, c))
            for k in range(warm_turns):
                await b.turn(f"warm {k}")
            bares.append(b)

    async def bare_turn(b: Bare, k: int) -> bool:
        t = time.perf_counter_ns()
        await b.turn(f"conc {k}")
        tp_lat_b.append((time.perf_counter_ns() - t) / 1e6)
        return True

    async def bare_chat(b: Bare) -> None:
        for k in range(rounds):
            await bare_turn(b, k)

    if tp_blocks > 1:
        room = mem_available() - sessions_took
        if room > MEM_SPARE * mem_total():
            await alternated_blocks(out, sup, conc, bares, warm_bare, daemon_turn, bare_turn, tp_blocks, tp_block_s)
            return await after_throughput(out, d, sup, user, runtime, conc, bares, failures, job, warm_turns, mixed_s,
                                          tp_rows, tp_lat_d, tp_lat_b)
        print(f"{runtime}: one block per throughput arm: {len(conc)} bare sessions beside the daemon's residents "
              f"would leave {room / 2**30:.1f} GiB of memory (they took {sessions_took / 2**30:.1f})", flush=True)
    await anyio.sleep(SETTLE_S)
    engine_calls = EngineCalls(sup)
    with engine_calls.counting():
        t = time.perf_counter()
        cpu0 = cpu_by_process()
        # the daemon arm's loop thread, in its CPU time (wall time would charge a send with the
        # time the thread waited for a core after waking its reader)
        profile = cProfile.Profile(time.thread_time) if os.environ.get("BENCH_PROFILE") else None
        if profile is not None:
            profile.enable()
        async with anyio.create_task_group() as tg:
            for c in conc:
                tg.start_soon(daemon_chat, c)
        out["tp_d"] = chats * rounds / (time.perf_counter() - t)
        if profile is not None:
            profile.disable()
            profile.dump_stats(f"{os.environ['BENCH_PROFILE']}.{runtime}")
        out["cpu_d"] = cpu_per_turn(cpu0, cpu_by_process(), chats * rounds)
    out["engine_calls"] = engine_calls.per_turn(chats * rounds)
    for c in conc:
        await sup.pool.retire((user, c, "m1"), "bench: the bare arm's turn")
    async with anyio.create_task_group() as tg:
        for c in conc:
            tg.start_soon(warm_bare, c)
    await anyio.sleep(SETTLE_S)
    t = time.perf_counter()
    cpu0 = cpu_by_process()
    async with anyio.create_task_group() as tg:
        for b in bares:
            tg.start_soon(bare_chat, b)
    out["tp_b"] = len(bares) * rounds / (time.perf_counter() - t)
    out["cpu_b"] = cpu_per_turn(cpu0, cpu_by_process(), len(bares) * rounds)
    return await after_throughput(out, d, sup, user, runtime, conc, bares, failures, job, warm_turns, mixed_s,
                                  tp_rows, tp_lat_d, tp_lat_b)


async def after_throughput(out: dict[str, Any], d: Any, sup: Any, user: str, runtime: str, conc: list[str],
                           bares: list[Bare], failures: list[str], job: Callable[..., dict[str, Any]],
                           warm_turns: int, mixed_s: float, tp_rows: list[list[tuple[str, float]]],
                           tp_lat_d: list[float], tp_lat_b: list[float]) -> dict[str, Any]:
    if failures:  # a run with failures still prints its figures, and says what failed
        print(f"{runtime}: {len(failures)} failures: {sorted(set(failures))}; residents retired for the memory "
              f"budget so far, by cause: {budget_retirements(sup) or 'none'}", flush=True)
    out["load"]["throughput"] = load()
    if mixed_s:
        out["tp_mixed"] = await mixed_window(d, job, conc, bares, runtime, warm_turns, mixed_s, failures)
    out["failures"] = failures
    out["tp_phases"], out["tp_lat_d"], out["tp_lat_b"] = tp_rows, tp_lat_d, tp_lat_b
    for b in bares:
        await b.close()
    for c in conc:
        await d.client.post(f"/v1/users/{user}/chats/{c}/stop")
    return out


def budget_retirements(sup: Any) -> dict[str, float]:
    """The daemon's count of idle residents retired for the memory budget, by cause."""
    out: dict[str, float] = {}
    for metric in sup.memory.metrics.retirements.collect():
        for sample in metric.samples:
            if sample.name.endswith("_total"):
                out[sample.labels["cause"]] = sample.value
    return out


async def bench_create(sup: Any, image: str, n: int) -> tuple[list[float], list[float], list[float]]:
    """A new chat's sandbox three ways, alternated: the manager's resolve (checks, volume,
    marker, record, the gate's ready line); the engine calls that make the same sandbox and
    nothing else (its volume, its container spec, the start: what the manager adds on top of
    them); the raw SDK's create+start of a bare container of the image (the issue's baseline)."""
    client = docker.from_env()
    mgr, same, raw = [], [], []
    for _ in range(n):
        chat = f"fresh-{uuid.uuid4().hex[:8]}"
        await sup.model_path.open("bench", chat)
        t = time.perf_counter()
        s = await sup.manager.resolve("bench", chat)
        mgr.append((time.perf_counter() - t) * 1000)
        sup.manager.release(s)
        client.api.remove_container(s.container_id, force=True)
        client.api.remove_volume(s.record.volume_name)
        spec = sup.manager.spec("bench", chat, s.record.data_root_id, s.image, s.record.volume_name)
        t = time.perf_counter()
        await sup.manager.engine.create_volume(s.record.volume_name, {})
        info = await sup.manager.engine.create(spec)
        await sup.manager.engine.start(info.id)
        same.append((time.perf_counter() - t) * 1000)
        client.api.remove_container(info.id, force=True)
        client.api.remove_volume(s.record.volume_name)
        t = time.perf_counter()
        c = client.containers.create(image, command=["sleep", "infinity"], init=True, network_mode="none",
                                     user="agent")
        c.start()
        raw.append((time.perf_counter() - t) * 1000)
        c.remove(force=True)
    return mgr, same, raw


@contextmanager
def model_fixture(tmp: Path, *, in_process: bool) -> Iterator[str]:
    """The loopback fixture's base URL. By default a process of its own, as `cloud-agent serve`
    runs it (runner.loopback_child): in this process its request parsing and SSE writing (16
    chats' model traffic under the throughput run) held the GIL the daemon's loop and store
    thread need, which a host's remote model never does. ``in_process``: as the benches ran it
    until stop 42, to compare."""
    if in_process:
        with LoopbackFixture.start() as fx:
            yield fx.base_url
    else:
        with loopback_child(tmp / "fixture-record.jsonl", tmp / "fixture-token") as url:
            yield url


async def main(args: argparse.Namespace) -> None:
    from telemetry.logs import configure_logging

    configure_logging(json=False, level="WARNING")
    image = ensure_image()
    stamps = Stamps()
    traces: dict[str, Any] = {}
    hooks = TestHooks(wrap_transport=stamps.wrap)
    if TRACING:
        hooks = TestHooks(wrap_transport=stamps.wrap, turn_trace=lambda tr: traces.__setitem__(tr.job_id, tr))
    results: dict[str, dict[str, Any]] = {}
    client = docker.from_env()
    with tempfile.TemporaryDirectory() as tmp, model_fixture(Path(tmp), in_process=args.fixture_in_process) as url:
        overrides: dict[str, Any] = {}
        if args.proxy_in_daemon:
            overrides["proxy_process"] = "daemon"
        if args.resident_memory_mb:
            overrides["resident_memory_mb"] = args.resident_memory_mb
        if args.capture:
            overrides["wire_capture"] = True
        settings = daemon_settings(Path(tmp) / "home", url, image, **overrides)
        async with (running_daemon(settings, hooks=hooks, proxy_process=not args.proxy_in_daemon) as d,
                    anyio.create_task_group() as client_tg):
            sup = d.daemon.supervisor
            if args.client in ("process", "lean"):
                d.remote = await RemoteClient.start(d.url, TOKEN, client_tg, lean=args.client == "lean")
            if not args.no_freeze:  # as `cloud-agent serve` does once ready (runner.heap)
                heap.freeze_startup()
            gc.callbacks.append(GC_CLOCK)
            try:
                # first, on a quiet host: after the throughput run the load average is ~15 for a while
                create_mgr, create_same, create_raw = await bench_create(sup, image, args.create_samples or max(3, args.n // 4))
                create_load = load()
                for runtime in args.runtimes.split(","):
                    results[runtime] = await bench_runtime(d, runtime, args.n, args.chats, args.rounds, stamps,
                                                           traces, keeper_arm=args.keeper_arm, restored=args.restored,
                                                           warm_turns=args.warm_turns, quiet_s=args.quiet_s,
                                                           instances=args.instances, mixed_s=args.mixed_s,
                                                           tp_blocks=args.tp_blocks, tp_block_s=args.tp_block_s)
                    # printed as each CLI finishes: a run cut short still leaves its figures
                    print(HEAD + "\n" + row(runtime, results[runtime]), flush=True)
                    print_phases({runtime: results[runtime]})
            finally:
                if getattr(d, "remote", None) is not None:
                    await d.remote.aclose()
                for rec in rows(sup.store, "sandboxes"):
                    try:
                        client.api.remove_container(rec["container_id"], force=True)
                    except docker.errors.NotFound:
                        pass
                # the chats' state volumes go too: nothing of the run is left behind
                host = settings.resolved_host_id()
                for vol in client.volumes.list(filters={"label": f"org.cloud-agent.host-id={host}"}):
                    vol.remove(force=True)
    print(f"\nsupervisor overhead, {args.n} LIVE turns per CLI, alternating daemon/bare; "
          f"throughput {args.chats} chats x {args.rounds} LIVE turns after {args.warm_turns} warm")
    print(HEAD)
    for runtime, r in results.items():
        print(row(runtime, r))
    m, same, raw = (statistics.median(xs) for xs in (create_mgr, create_same, create_raw))
    print(f"create+start: manager {m:.1f} ms, raw SDK {raw:.1f} ms, ratio {m / raw:.3f}; the same sandbox's engine "
          f"calls (volume, create, start) {same:.1f} ms, ratio {m / same:.3f} (load {create_load})")
    print_phases(results)


HEAD = (f"{'runtime':9} {'LIVE d p50':>10} {'bare p50':>9} {'added p50':>9} {'added p99':>9} "
        f"{'RESTORED d':>10} {'bare':>7} {'ratio':>6} {'1st ev p50':>10} {'tp d/s':>7} {'tp bare':>7} "
        f"{'tp ratio':>8} {'fail':>4}  load (live|restored|tp)")


def row(runtime: str, r: dict[str, Any]) -> str:
    added = [a - b for a, b in zip(r["live_d"], r["live_b"], strict=True)]
    first = f"{statistics.median(r['first']):8.2f}ms" if r["first"] else f"{'-':>10}"
    line = (f"{runtime:9} {statistics.median(r['live_d']):10.1f} {statistics.median(r['live_b']):9.1f} "
            f"{statistics.median(r['live_d']) - statistics.median(r['live_b']):9.1f} {pct(added, 99):9.1f} "
            f"{restored_cells(r)} {first} "
            f"{r['tp_d']:7.2f} {r['tp_b']:7.2f} {r['tp_d'] / r['tp_b'] if r['tp_b'] else math.nan:8.3f} {len(r['failures']):4}  "
            f"{r['load']['live']}|{r['load']['restored']}|{r['load']['throughput']}")
    lo, hi = added_interval(r["live_d"], r["live_b"])
    line += f"\n  {runtime}: LIVE added p50, 95% interval [{lo:.1f}, {hi:.1f}] ms over {len(r['live_d'])} turn pairs"
    if r["rest_d"]:
        lo, hi = ratio_interval(r["rest_d"], r["rest_b"])
        line += (f"\n  {runtime}: RESTORED ratio, 95% interval [{lo:.3f}, {hi:.3f}] over {len(r['rest_d'])} "
                 f"stop-and-start pairs")
    if len(r["live_d"]) >= 40:
        line += f"\n  {runtime}: {by_history(r['live_d'], r['live_b'], r.get('instances', 1))}"
    if r.get("tp_pairs"):
        pairs = r["tp_pairs"]
        line += (f"\n  {runtime}: throughput ratio by block pair ({len(pairs)} alternated, windows of "
                 f"{r['tp_window_s']:g} s): "
                 f"{', '.join(f'{x:.3f}' for x in pairs)}; median "
                 f"{statistics.median([x for x in pairs if not math.isnan(x)] or [math.nan]):.3f}")
    for text in r.get("sched_idle", []):
        line += f"\n  {runtime}: {text}"
    if r["failures"]:
        line += f"\n  failures: {r['failures']}"
    return line


def restored_cells(r: dict[str, Any]) -> str:
    """The row's RESTORED medians and ratio, or dashes for a run with ``--restored 0``."""
    if not r["rest_d"]:
        return f"{'-':>10} {'-':>7} {'-':>6}"
    d, b = statistics.median(r["rest_d"]), statistics.median(r["rest_b"])
    return f"{d:10.0f} {b:7.0f} {d / b:6.3f}"


def ledger_bytes(db: Path, user: str, chat: str, members: list[str]) -> str:
    """What the wire ledger keeps of the LIVE arm's members (SQLite): its records (digests), the
    turns' baselines and, with ``--capture``, the captured texts. Every request carries the
    member's whole history: stored whole, a member's bytes grew with the square of its turns
    (proxy.stored_digest)."""
    if not db.exists():
        return "the wire ledger: not SQLite, not measured"
    marks = ",".join("?" * len(members))
    with closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
        records, captured = con.execute(
            f"SELECT COALESCE(SUM(LENGTH(record_json)), 0), COALESCE(SUM(LENGTH(capture_json)), 0) FROM wire_records"
            f" WHERE user_id=? AND chat_id=? AND member_id IN ({marks})", (user, chat, *members)).fetchone()
        turns, baselines = con.execute(f"SELECT COUNT(*), COALESCE(SUM(LENGTH(baseline_json)), 0) FROM wire_turns "
                                       f"WHERE user_id=? AND chat_id=? AND member_id IN ({marks})",
                                       (user, chat, *members)).fetchone()
    return (f"the wire ledger after {turns} turns of {len(members)} member(s): records {records / 2**20:.1f} MiB, "
            f"turn baselines {baselines / 2**20:.1f} MiB, captured texts {captured / 2**20:.1f} MiB")


def own_by_history(rows: list[list[tuple[str, float]]]) -> str:
    """The own phases' sum over the first and the last quarter of the LIVE turns (in order), and
    the three phases whose medians grew the most between them: where a longer history costs."""
    q = len(rows) // 4
    if q < 2:
        return "own phases by history: too few turns"
    first, last = rows[:q], rows[-q:]

    def med(part: list[list[tuple[str, float]]], name: str | None) -> float:
        vals = [sum(ms for k, ms in row if not k.startswith(CLI_SPANS) and (name is None or k == name))
                for row in part]
        return statistics.median(vals)

    names = {k for row in rows for k, _ in row if not k.startswith(CLI_SPANS)}
    grew = sorted(((med(last, k) - med(first, k), k) for k in names), reverse=True)[:3]
    return (f"own phases by history: p50 {med(first, None):.2f} ms over the first quarter of the turns, "
            f"{med(last, None):.2f} ms over the last; grew most: "
            + ", ".join(f"{k} {d:+.2f} ms" for d, k in grew))


def by_history(live_d: list[float], live_b: list[float], instances: int) -> str:
    """LIVE added p50 over the first and the last quarter of the turn pairs: a member's history
    grows a turn at a time, and every request carries all of it (the proxy digests it, the
    judge compares it), so a cost that grows with it shows as a difference here."""
    q = len(live_d) // 4
    first = statistics.median(live_d[:q]) - statistics.median(live_b[:q])
    last = statistics.median(live_d[-q:]) - statistics.median(live_b[-q:])
    n = len(live_d) // instances  # each instance's turns, in turn
    return (f"LIVE added p50 by history: {first:.1f} ms over turns 1-{q // instances} of each member, "
            f"{last:.1f} ms over turns {n - q // instances + 1}-{n}")


def added_interval(live_d: list[float], live_b: list[float], draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% interval of median(daemon) - median(bare): the turn pairs resampled
    together (each pair ran back to back, so the machine's moment is shared). One run's p50 of
    OpenCode or Kilo moves by more than the 5 ms goal; the interval says how far it can."""
    return pair_interval(live_d, live_b, lambda d, b: d - b, draws)


def ratio_interval(rest_d: list[float], rest_b: list[float], draws: int = 2000) -> tuple[float, float]:
    """A bootstrap 95% interval of median(daemon) / median(bare) for the RESTORED turns, each
    pair a stop and a start of the same container back to back. With 5 pairs it is wide: one
    run's ratio has moved between 0.93 and 1.13 for the same tree."""
    return pair_interval(rest_d, rest_b, lambda d, b: d / b, draws)


def pair_interval(xs_d: list[float], xs_b: list[float], stat: Callable[[float, float], float],
                  draws: int) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of ``stat(median(d), median(b))`` over the pairs resampled."""
    rng = random.Random(16)  # the same run prints the same interval
    n = len(xs_d)
    got = []
    for _ in range(draws):
        idx = [rng.randrange(n) for _ in range(n)]
        got.append(stat(statistics.median(xs_d[i] for i in idx), statistics.median(xs_b[i] for i in idx)))
    return pct(got, 2.5), pct(got, 97.5)


# the spans of a LIVE turn that hold the driver's and the CLI's own work, which the bare arm has too
CLI_SPANS = ("input_sent", "first_event", "settled")


def print_phases(results: dict[str, dict[str, Any]]) -> None:
    if not any(r["phases"] for r in results.values()):
        return
    print("\nLIVE turn per-phase breakdown, one turn at a time | under the throughput run "
          "(median ms since the previous mark; p90 under load)")
    phases: list[str] = []
    for r in results.values():
        for trace_row in r["phases"] + r.get("tp_phases", []):
            for name, _ in trace_row:
                if name not in phases:
                    phases.append(name)
    print(f"{'phase':22}" + "".join(f"{rt + ' 1':>10}{rt + ' tp':>11}{'p90':>8}" for rt in results))

    def cell(rows: list[list[tuple[str, float]]], name: str, p: float, width: int) -> str:
        vals = [ms for trace_row in rows for k, ms in trace_row if k == name]
        return f"{pct(vals, p):{width}.2f}" if vals else f"{'-':>{width}}"

    for name in phases:
        print(f"{name:22}" + "".join(cell(r["phases"], name, 50, 10) + cell(r.get("tp_phases", []), name, 50, 11)
                                     + cell(r.get("tp_phases", []), name, 90, 8) for r in results.values()))
    for rt, r in results.items():
        if r["phases"]:
            own = [sum(ms for k, ms in trace_row if not k.startswith(CLI_SPANS)) for trace_row in r["phases"]]
            print(f"{rt}: the supervisor's own phases of a LIVE turn (all but {', '.join(CLI_SPANS)}), summed "
                  f"per turn: p50 {statistics.median(own):.2f} ms, p90 {pct(own, 90):.2f} ms, p99 {pct(own, 99):.2f} ms, "
                  f"max {max(own):.2f} ms")
            worst = sorted(((ms, k) for trace_row in r["phases"] for k, ms in trace_row if not k.startswith(CLI_SPANS)),
                           reverse=True)[:5]
            print(f"{rt}: its five longest own spans: " + ", ".join(f"{k} {ms:.1f} ms" for ms, k in worst))
            print(f"{rt}: {own_by_history(r['phases'])}")
    if any(r.get("rest_phases") for r in results.values()):
        # where a RESTORED turn's time goes (its bare arm: engine start, gate, exec, resume, turn)
        print("\nRESTORED turn per-phase breakdown after a stop (median ms since the previous mark)")
        names: list[str] = []
        for r in results.values():
            for trace_row in r.get("rest_phases", []):
                for name, _ in trace_row:  # a phase marked more than once in a turn is one row
                    if name not in names:
                        names.append(name)
        print(f"{'phase':22}" + "".join(f"{rt:>10}" for rt in results))
        for name in names:
            print(f"{name:22}" + "".join(cell(r.get("rest_phases", []), name, 50, 10) for r in results.values()))
        print("... and its bare arm's (median ms)")
        for name in ("engine_start", "gate_ready", "attached", "handshake", "turn"):
            print(f"{name:22}" + "".join(cell(r.get("rest_bare", []), name, 50, 10) for r in results.values()))
    for rt, r in results.items():
        if r.get("cpu_live_d") and r.get("cpu_live_b"):
            print(f"{rt}: CPU ms per LIVE turn, one at a time, by process (daemon arm | bare arm)")
            d, b = r["cpu_live_d"], r["cpu_live_b"]
            for k in table_order([k for k in set(d) | set(b) if max(d.get(k, 0.0), b.get(k, 0.0)) >= 0.5], d):
                print(f"  {k:36} {d.get(k, 0.0):8.1f} {b.get(k, 0.0):8.1f}")
        if r.get("cpu_d") and r.get("cpu_b"):
            print(f"{rt}: CPU ms per turn under the throughput run, by process (daemon arm | bare arm)")
            for k in table_order(list(set(r["cpu_d"]) - {WAY_KEY} | set(r["cpu_b"]) - {WAY_KEY}), r["cpu_d"]):
                print(f"  {k:36} {r['cpu_d'].get(k, 0.0):8.1f} {r['cpu_b'].get(k, 0.0):8.1f}")
            print(way_line(rt, r["cpu_d"], r["cpu_b"]))
        if r.get("engine_calls") is not None:
            calls = ", ".join(f"{k} {v:.2f}" for k, v in r["engine_calls"].items()) or "none"
            print(f"{rt}: the daemon's engine calls per turn under the throughput run: {calls}")
        if r.get("tp_lat_d") and r.get("tp_lat_b"):
            print(f"{rt}: a turn under the throughput run, p50 daemon {pct(r['tp_lat_d'], 50):.1f} ms, "
                  f"bare {pct(r['tp_lat_b'], 50):.1f} ms; p90 {pct(r['tp_lat_d'], 90):.1f} / {pct(r['tp_lat_b'], 90):.1f} ms")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("n", nargs="?", type=int, default=20)
    ap.add_argument("--runtimes", default=",".join(RUNTIMES))
    ap.add_argument("--chats", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--restored", type=int, default=3, help="RESTORED turns per arm (each a stop and a start)")
    ap.add_argument("--create-samples", type=int, default=None,
                    help="new sandboxes per arm for the create+start ratio (default N/4, at least 3): its "
                         "engine start moves by +-10 ms from one to the next, so a few samples move the ratio by 5%%")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop",
                    help="the loop this process (the daemon and the bare arm's drivers) runs on: uvloop, as "
                         "`cloud-agent serve` runs (runner.event_loop), or asyncio's own, as before")
    ap.add_argument("--keeper-arm", action="store_true",
                    help="a third LIVE arm: the bare session under a keeper, as the daemon runs its CLIs (its "
                         "difference from the bare exec is the keeper hop's share of a turn)")
    ap.add_argument("--proxy-in-daemon", action="store_true",
                    help="CLOUD_AGENT_PROXY_PROCESS=daemon: the model proxy on the daemon's loop and store connection "
                         "instead of the service process production runs (which writes the wire ledger into the "
                         "same SQLite file from another process)")
    ap.add_argument("--quiet-s", type=float, default=0.0,
                    help="before each LIVE turn of either arm, wait up to this long for the host's CPUs to be "
                         "under 10%% busy (50 ms windows): OpenCode's and Kilo's after-turn work otherwise lands "
                         "on the other arm's next turn, both arms' CLIs sharing one container. The LIVE arms' CPU "
                         "per turn then leaves that after-turn work out")
    ap.add_argument("--instances", type=int, default=1,
                    help="CLI processes per LIVE arm (daemon members m1..mK, bare sessions bare1..bareK in the "
                         "same container), taken in turn: two OpenCode or Kilo processes differ by ~10 ms of "
                         "their own work a turn, which one process per arm counts as the supervisor's")
    ap.add_argument("--tp-blocks", type=int, default=1,
                    help="the throughput arms in this many pairs of windows of --tp-block-s seconds, alternated "
                         "(daemon-bare, bare-daemon, ...) with both arms' sessions alive at once, where memory "
                         "allows; the default, one block each of --rounds turns a chat, runs the bare arm after "
                         "the daemon's residents are retired")
    ap.add_argument("--tp-block-s", type=float, default=5.0,
                    help="with --tp-blocks: each block is a window of this many seconds, every chat taking turn "
                         "after turn (the turns that ended in it are counted); --rounds is then unused")
    ap.add_argument("--mixed-s", type=float, default=0.0,
                    help="after the throughput run: half the chats through the daemon and half bare, at once for "
                         "this long; the turns each arm completed in the same window")
    ap.add_argument("--warm-turns", type=int, default=1,
                    help="turns each throughput chat takes, in both arms, before the measured rounds: the CLIs' "
                         "own warm-up (JIT) dominates a chat's first turns (pi: 23 ms of CPU a turn there, 4-6 "
                         "ms in steady state), so 3 or more measures the supervisor rather than the CLI")
    ap.add_argument("--capture", action="store_true",
                    help="CLOUD_AGENT_WIRE_CAPTURE=1: the ledger keeps the message texts too (the line on the "
                         "wire ledger then shows what they take)")
    ap.add_argument("--resident-memory-mb", type=int, default=None,
                    help="the daemon's resident memory budget (CLOUD_AGENT_RESIDENT_MEMORY_MB; default half the "
                         "host's). The bare arm has none: 16 Kilo residents measured over 768 MiB each exceed half "
                         "of 24 GiB, the daemon retires idle ones and their turns come back RESTORED")
    ap.add_argument("--no-freeze", action="store_true",
                    help="leave this process's start-up objects to the garbage collector's full collections "
                         "(`cloud-agent serve` freezes them once ready: runner.heap; so does this bench by default)")
    ap.add_argument("--fixture-in-process", action="store_true",
                    help="the loopback fixture in this process (on its own threads, sharing the daemon's GIL) "
                         "instead of a process of its own as `cloud-agent serve` runs it")
    ap.add_argument("--client", choices=("process", "lean", "inline"), default="process",
                    help="the API client in a process of its own (as a host's clients are; httpx, or with `lean` "
                         "the leanest HTTP/1.1 client, see api_client.py) or on the daemon's loop")
    args = ap.parse_args()
    anyio.run(main, args, backend_options=event_loop.BACKEND_OPTIONS if args.loop == "uvloop" else {})
