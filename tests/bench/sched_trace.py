"""Who ran while a CPU idled: the kernel's context switches over the throughput windows.

``BENCH_SCHED_TRACE=1 bench_supervisor --tp-blocks K`` records every ``sched:sched_switch`` on the host
(``perf record -a``, stamped on CLOCK_MONOTONIC, the clock of ``time.perf_counter``) while the
arms' windows run. From the switches each CPU's timeline is rebuilt, and every moment where
some CPUs idled and others ran is charged to what ran: the idle CPU time, split evenly among
the running tasks' groups. A group is a process by what it runs (the bench's labels), and the
bench's own process by thread: its loop thread, its other threads.

The question it answers (issue 16): the daemon's windows leave the host's CPUs idle 1.2-1.7 ms
a turn against 0.4-0.5 in the bare ones. If at those moments only the daemon's process runs,
every chat is waiting on it, and its latency (not only its CPU) bounds the throughput.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

NOTHING = "(nothing: every CPU idle)"
ARM_NAMES = {"d": "daemon", "b": "bare"}
UNKNOWN = "?"
_SWITCH = re.compile(r"^\s*(\d+)/(\d+)\s+\[(\d+)\]\s+([\d.]+):.*?prev_state=(\S+) ==> .*?next_pid=(\d+)")


@dataclass(frozen=True)
class Switch:
    time: float
    cpu: int
    prev_tid: int  # the task switched out (the sample's own task)
    prev_pid: int  # … and its process
    next_tid: int  # the task switched in (0: the CPU idles)
    preempted: bool = False  # the task switched out was still runnable (prev_state R)


def parse(lines: Iterable[str]) -> Iterator[Switch]:
    """``perf script -F tid,pid,cpu,time,trace --ns`` lines of ``sched:sched_switch``."""
    for line in lines:
        m = _SWITCH.match(line)
        if m:
            pid, tid, cpu, t, state, nxt = m.groups()
            yield Switch(float(t), int(cpu), int(tid), int(pid), int(nxt), state.startswith("R"))


@dataclass
class IdleShare:
    """One arm's windows: idle CPU seconds, by what ran meanwhile."""

    seconds: float = 0.0  # wall seconds covered
    idle: float = 0.0  # idle CPU seconds
    by_group: dict[str, float] = field(default_factory=dict)

    def add(self, group: str, s: float) -> None:
        self.by_group[group] = self.by_group.get(group, 0.0) + s


def _pid_of(switches: list[Switch]) -> dict[int, int]:
    """Each task's process, learnt from its first switch out (a task seen only switching in
    keeps its tid as its process)."""
    pid_of: dict[int, int] = {}
    for s in switches:
        pid_of.setdefault(s.prev_tid, s.prev_pid)
    return pid_of


def attribute(switches: list[Switch], windows: list[tuple[str, float, float]], cpus: int,
              group_of: Callable[[int, int], str]) -> dict[str, IdleShare]:
    """Charge each window's idle CPU time to the groups that ran beside it. ``switches`` in
    time order (as ``SchedTrace.stop`` returns them); ``group_of(tid, pid)`` names a task's
    group. A CPU is counted once a switch on it is seen (its task before that is unknown)."""
    pid_of = _pid_of(switches)
    out: dict[str, IdleShare] = {arm: IdleShare() for arm, _, _ in windows}
    running: dict[int, int] = {}  # cpu -> tid on it (0: idle)
    ordered = sorted(windows, key=lambda w: w[1])
    now = switches[0].time if switches else 0.0

    def charge(until: float) -> None:
        if len(running) < cpus or until <= now:
            return
        # The CPUs' state holds from ``now`` to ``until``: read it once for every window.
        busy = [tid for tid in running.values() if tid != 0]
        idle = len(running) - len(busy)
        for arm, start, end in ordered:
            lo, hi = max(now, start), min(until, end)
            if hi <= lo:
                continue
            share = out[arm]
            share.seconds += hi - lo
            if not idle:
                continue
            share.idle += idle * (hi - lo)
            if not busy:
                share.add(NOTHING, idle * (hi - lo))
                continue
            for tid in busy:
                share.add(group_of(tid, pid_of.get(tid, tid)), idle * (hi - lo) / len(busy))

    for s in switches:
        charge(s.time)
        now = max(now, s.time)
        running[s.cpu] = s.next_tid
    return out


@dataclass
class Preemptions:
    """One arm's windows: how often a task was switched out still runnable, by what came in,
    and how long it then waited for a core again."""

    count: int = 0
    waited: float = 0.0
    by_group: dict[str, int] = field(default_factory=dict)


def preemptions(switches: list[Switch], windows: list[tuple[str, float, float]], tid: int,
                group_of: Callable[[int, int], str]) -> dict[str, Preemptions]:
    """``tid``'s preemptions in each arm's windows (by the window it was switched out in);
    ``switches`` in time order."""
    pid_of = _pid_of(switches)
    out = {arm: Preemptions() for arm, _, _ in windows}
    out_at: tuple[float, str] | None = None
    for s in switches:
        if s.next_tid == tid and out_at is not None:
            out[out_at[1]].waited += s.time - out_at[0]
            out_at = None
        if s.prev_tid != tid:
            continue
        arm = next((a for a, start, end in windows if start <= s.time < end), None)
        out_at = None
        if s.preempted and arm is not None:
            share = out[arm]
            share.count += 1
            g = group_of(s.next_tid, pid_of.get(s.next_tid, s.next_tid)) if s.next_tid else "(idle)"
            share.by_group[g] = share.by_group.get(g, 0) + 1
            out_at = (s.time, arm)
    return out


class SchedTrace:
    """``perf record`` of every context switch while it is open; ``window`` marks an arm's
    window; ``stop`` reads the trace back, in time order. Needs root and perf (Debian's linux-perf)."""

    def __init__(self, label_of_pid: Callable[[str], str], keep: Path | None = None) -> None:
        """``keep``: a directory the trace (perf.data) and its windows (windows.json) stay in."""
        self._label_of_pid = label_of_pid
        self._keep = keep
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
        self._dir = keep or Path(tempfile.mkdtemp(prefix="sched-trace-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self.windows: list[tuple[str, float, float]] = []
        self.labels: dict[int, str] = {}

    @staticmethod
    def available() -> str | None:
        """Why it cannot run here, or None."""
        if shutil.which("perf") is None:
            return "perf is not installed (Debian: linux-perf)"
        if os.geteuid() != 0:
            return "perf needs root to trace every CPU"
        return None

    def start(self) -> None:
        self._proc = subprocess.Popen(
            ["perf", "record", "-q", "-e", "sched:sched_switch", "-a", "-k", "CLOCK_MONOTONIC",
             "-o", str(self._dir / "perf.data")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def window(self, arm: str, start: float, end: float) -> None:
        self.windows.append((arm, start, end))
        self._snapshot()

    def _snapshot(self) -> None:
        """Every live process's label, by pid (CLIs and services outlive the windows)."""
        for pid in os.listdir("/proc"):
            if pid.isdigit() and int(pid) not in self.labels:
                self.labels[int(pid)] = self._label_of_pid(pid)

    def stop(self) -> list[Switch]:
        proc, self._proc = self._proc, None
        if proc is None:
            return []
        proc.send_signal(signal.SIGINT)
        proc.wait()
        text = subprocess.run(["perf", "script", "-i", str(self._dir / "perf.data"), "--ns",
                               "-F", "tid,pid,cpu,time,trace"], capture_output=True, text=True).stdout
        if self._keep is None:
            shutil.rmtree(self._dir, ignore_errors=True)
        else:
            (self._dir / "windows.json").write_text(json.dumps({"windows": self.windows, "pid": os.getpid(),
                                                               "labels": self.labels}))
        return sorted(parse(text.splitlines()), key=lambda s: s.time)

    def group_of(self, own_pid: int) -> Callable[[int, int], str]:
        def group(tid: int, pid: int) -> str:
            if pid == own_pid:
                return "this process: its loop thread" if tid == pid else "this process: its other threads"
            return self.labels.get(pid, UNKNOWN)
        return group


def preemption_report(pre: dict[str, Preemptions], turns: dict[str, int], top: int = 6) -> list[str]:
    """The loop thread's preemptions a turn and the wait after them, and what preempted it."""
    lines = []
    for arm in ("d", "b"):
        if arm not in pre:
            continue
        p, n = pre[arm], max(1, turns.get(arm, 0))
        by = sorted(p.by_group.items(), key=lambda kv: -kv[1])[:top]
        lines.append(f"the loop thread, {ARM_NAMES[arm]} arm: preempted {p.count / n:.1f} times a turn, then off a core "
                     f"{1000 * p.waited / n:.2f} ms a turn; by " + ", ".join(f"{g} {c / n:.2f}" for g, c in by))
    return lines


def report(shares: dict[str, IdleShare], turns: dict[str, int], top: int = 8) -> list[str]:
    """Idle CPU ms a turn, by what ran meanwhile, the arms side by side."""
    arms = [a for a in ("d", "b") if a in shares]

    def per_turn(arm: str, seconds: float) -> float:
        return 1000.0 * seconds / max(1, turns.get(arm, 0))

    groups = sorted({g for a in arms for g in shares[a].by_group},
                    key=lambda g: -max(shares[a].by_group.get(g, 0.0) for a in arms))
    lines = ["idle CPU ms a turn, by what ran meanwhile (perf sched_switch):",
             f"  {'':44s}" + "".join(f"{ARM_NAMES[a]:>10s}" for a in arms),
             f"  {'idle, all of it':44s}" + "".join(f"{per_turn(a, shares[a].idle):10.2f}" for a in arms)]
    for g in groups[:top]:
        lines.append(f"  {g[:44]:44s}" + "".join(f"{per_turn(a, shares[a].by_group.get(g, 0.0)):10.2f}" for a in arms))
    rest = groups[top:]
    if rest:
        lines.append(f"  {'the rest':44s}" + "".join(
            f"{per_turn(a, sum(shares[a].by_group.get(g, 0.0) for g in rest)):10.2f}" for a in arms))
    return lines
