"""Test-only: a load of chats across the five CLIs through a real daemon, with an independent
memory sampler and an exact history check of every turn in the fixture's audit.

Used by the CI-sized test (tests/cli/test_capacity_load.py) and by tests/bench/load.py.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import docker

from deploy.loopback import LoopbackFixture, assert_history
from tests.daemon_harness import RunningDaemon
from tests.supervisor_helpers import Chat

RUNTIMES = ("claude", "codex", "pi", "opencode", "kilo")
MiB = 1024 * 1024


def cli_rss_of_container(init_pid: int) -> int:
    return sum(rss for _, rss in cli_processes_of_container(init_pid))


def cli_processes_of_container(init_pid: int) -> list[tuple[str, int]]:
    """RSS of every process in the sandbox but the sandbox's own: its init (docker-init) and the
    container's command (``ca-modelgate``, the init's first child: keepers daemonize and are
    re-parented to the init too, later; the command lives as long as the sandbox
    runs, resident or not, so the running-sandbox limit bounds it, not the resident budget). What
    is left is what the budget is for: the keepers, the CLIs, their children and any exec'd
    helper, read from the host's /proc and the cgroup — independently of the daemon's own
    bookkeeping. A child still in its parent's address space (a spawn before its exec: the
    kernel's kcmp says so) holds no memory of its own and is not counted: /proc shows it with
    its parent's RSS to the byte, and this sum read a Kilo turn's spawn as a second Kilo."""
    from sandbox_manager.proc_memory import ProcMemory
    from sandbox_manager.shared_vm import same_vm

    reader = ProcMemory(pss=False)
    procs_file = reader.cgroup_procs_file(init_pid)
    if procs_file is None:
        return []
    try:
        pids = [int(p) for p in procs_file.read_text().split()]
    except OSError:
        return []
    procs: list[tuple[int, int, int, int]] = []  # (pid, ppid, pgrp, start time) per live process
    for pid in pids:
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        procs.append((pid, int(fields[1]), int(fields[2]), int(fields[19])))
    children = sorted((start, pid) for pid, ppid, _, start in procs if ppid == init_pid)
    own = {init_pid} | ({children[0][1]} if children else set())
    out: list[tuple[str, int]] = []  # (name, rss bytes)
    for pid, ppid, pgrp, _ in procs:
        # the kernel's answer first, the reading after: a status read while the spawn still ran in
        # its parent's address space stays the parent's even once it has exec'd (stop 42's CI: a
        # Kilo spawn counted as a second 539 MiB Kilo, the peak 1516 MiB against the daemon's 1191)
        if pgrp in own or same_vm(ppid, pid):
            continue
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        lines = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if "VmRSS" in lines:
            out.append((lines.get("Name", "?").strip(), int(lines["VmRSS"].split()[0]) * 1024))
    return out


@dataclass
class MemorySampler:
    """Samples the summed CLI RSS of every sandbox of one host id, every ``period_s``."""

    host_id: str
    period_s: float = 0.25
    peak_bytes: int = 0
    samples: int = 0
    # at the peak: (container, process name, rss) of every process counted
    peak_processes: list[tuple[str, str, int]] = field(default_factory=list)
    # at the peak: what ``context()`` said (e.g. the daemon's own view of its budget)
    peak_context: object = None
    context: Callable[[], object] | None = None
    _inits: dict[str, int] = field(default_factory=dict)

    def _sample(self) -> int:
        client = docker.DockerClient(base_url="unix:///var/run/docker.sock")
        try:
            rows = client.api.containers(filters={"label": f"org.cloud-agent.host-id={self.host_id}",
                                                  "status": "running"})
            counted: list[tuple[str, str, int]] = []
            for row in rows:
                cid = row["Id"]
                if cid not in self._inits:
                    try:
                        self._inits[cid] = client.api.inspect_container(cid)["State"]["Pid"]
                    except docker.errors.NotFound:
                        continue
                counted += [(cid[:12], name, rss) for name, rss in cli_processes_of_container(self._inits[cid])]
            total = sum(rss for _, _, rss in counted)
            if total > self.peak_bytes:
                self.peak_processes = counted
                self.peak_context = self.context() if self.context is not None else None
            return total
        finally:
            client.close()

    async def run(self) -> None:
        while True:
            value = await anyio.to_thread.run_sync(self._sample)
            self.peak_bytes = max(self.peak_bytes, value)
            self.samples += 1
            await anyio.sleep(self.period_s)


@dataclass
class TurnResult:
    runtime: str
    status: str | None
    outcome: str
    latency_ms: int
    history_ok: bool
    detail: str = ""


@dataclass
class LoadResult:
    turns: list[TurnResult]
    wall_s: float
    peak_bytes: int
    samples: int
    budget_retirements: dict[str, float]

    @property
    def failed(self) -> list[TurnResult]:
        return [t for t in self.turns if t.outcome != "succeeded"]

    @property
    def history_mismatches(self) -> list[TurnResult]:
        return [t for t in self.turns if not t.history_ok]

    def latency_by_status(self) -> dict[str, tuple[int, float, float]]:
        """status -> (count, p50 ms, p99 ms)."""
        out = {}
        by: dict[str, list[int]] = {}
        for t in self.turns:
            by.setdefault(t.status or "none", []).append(t.latency_ms)
        for status, values in sorted(by.items()):
            values.sort()
            p99 = values[min(len(values) - 1, max(0, int(round(0.99 * len(values))) - 1))]
            out[status] = (len(values), statistics.median(values), p99)
        return out

    def statuses(self) -> Counter[str]:
        return Counter(t.status or "none" for t in self.turns)


def chats_for(n: int) -> list[Chat]:
    return [Chat(RUNTIMES[i % len(RUNTIMES)]) for i in range(n)]


def turn_request(fx: LoopbackFixture, message: str) -> list[Any]:
    return [r for r in fx.requests(kind="conversation")
            if [m.text for m in r.conversation() if m.role == "user"][-1:] == [message]]


async def run_load(d: RunningDaemon, fx: LoopbackFixture, chats: list[Chat], turns: int,
                   sampler: MemorySampler) -> LoadResult:
    results: list[TurnResult] = []

    async def one_chat(i: int, chat: Chat) -> None:
        for n in range(turns):
            message = f"load chat {i} ({chat.runtime}) turn {n + 1}"
            reply = chat.expect_turn(message)
            t0 = time.monotonic()
            receipt, events, resp = await d.run(chat.job(message))
            latency = int((time.monotonic() - t0) * 1000)
            if receipt is None:
                results.append(TurnResult(chat.runtime, None, f"http_{resp.status_code}", latency, False,
                                          str(events)[:300]))
                chat.history = chat.history[:-2]
                return
            ok = receipt["outcome"] == "succeeded" and receipt["assistant_text"] == reply
            history_ok, detail = False, ""
            seen = turn_request(fx, message)
            if len(seen) == 1:
                try:
                    assert_history(chat.expected_request(), seen[0].conversation())
                    history_ok = True
                except AssertionError as exc:
                    detail = str(exc)[:500]
            else:
                detail = f"{len(seen)} conversational requests carried this turn's message"
            if not ok:
                detail = f"{(receipt.get('settlement') or {}).get('detail')} | {detail}"
            results.append(TurnResult(chat.runtime, receipt["context_status"],
                                      receipt["outcome"] if ok else f"{receipt['outcome']}:{receipt['reason']}",
                                      latency, history_ok, detail))
            if not ok:
                return

    t0 = time.monotonic()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sampler.run)
        async with anyio.create_task_group() as chats_tg:
            for i, chat in enumerate(chats):
                chats_tg.start_soon(one_chat, i, chat)
        wall = time.monotonic() - t0
        tg.cancel_scope.cancel()
    metrics = (await d.client.get("/metrics")).text
    from prometheus_client.parser import text_string_to_metric_families

    retirements = {s.labels["cause"]: s.value for fam in text_string_to_metric_families(metrics)
                   for s in fam.samples if s.name == "cloud_agent_resident_memory_retirements_total"}
    return LoadResult(turns=results, wall_s=wall, peak_bytes=sampler.peak_bytes, samples=sampler.samples,
                      budget_retirements=retirements)
