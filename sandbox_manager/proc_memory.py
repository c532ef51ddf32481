"""Memory of process groups inside a sandbox, read from the host — no exec per reading.

Each resident CLI is a process-group leader whose in-container pid (= its pgid) is in its
pidfile. From the host: the container's init pid (the engine's ``State.Pid``) names its
cgroup (``/proc/<pid>/cgroup``; cgroup v1 or v2, detected), whose ``cgroup.procs`` lists
the host pids of every process in the sandbox; ``NSpid`` in ``/proc/<pid>/status`` maps
each to its in-container pid, and ``/proc/<pid>/stat`` gives its process group and
parent. A group's memory is the sum over its processes and their descendants (a child
that left the group still belongs to the resident) of RSS (``VmRSS``) and of PSS
(``smaps_rollup``) — a child still in its parent's address space (a spawn before its exec,
:mod:`sandbox_manager.shared_vm`) counted once, with its parent. A keeper's relay — the
attached exec (``ca-keeper run|attach --socket PATH``) that carries the daemon's link to it
where the host does not link to the keeper's socket itself (sandbox_manager.keeper_link), in a
session of its own and not the keeper's child after a re-attach — belongs to the resident too: it lives as long as the link, and it is a Python process of ~12 MiB. Everything
here is blocking file I/O: call it in a worker thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from sandbox_manager.shared_vm import same_vm


@dataclass(frozen=True)
class GroupMemory:
    pgid: int  # in the container's pid namespace
    pids: int
    rss_bytes: int
    pss_bytes: int
    hwm_bytes: int  # the sum of each process's peak RSS (VmHWM): what the group has needed at most

    @property
    def bytes(self) -> int:
        """What the budget counts: the tree's peak RSS. PSS splits the pages residents of one
        image share (the CLI binary), so one resident's PSS halves when a second starts and
        doubles back when it retires; RSS is stable and its sum never under-counts; the peak
        is what the tree has already needed and may need again (a CLI's start-up peak is
        well above its idle RSS: Claude 292 vs 221 MiB)."""
        return max(self.hwm_bytes, self.rss_bytes)


@dataclass(frozen=True)
class _Proc:
    host_pid: int
    ns_pid: int
    ppid: int  # host
    pgrp: int  # host
    rss_bytes: int
    hwm_bytes: int


class ProcMemory:
    def __init__(self, proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup", pss: bool = True,
                 shares_vm: Callable[[int, int], bool] = same_vm) -> None:
        self.proc = Path(proc)
        self.cgroup_root = Path(cgroup_root)
        self.pss = pss
        self.same_vm = shares_vm  # host pids (parent, child): the child still runs in its parent's address space

    def available(self) -> bool:
        return (self.proc / "self" / "status").exists()

    def cgroup_procs_file(self, init_pid: int) -> Path | None:
        """The cgroup.procs of the container whose init has host pid ``init_pid``."""
        try:
            lines = (self.proc / str(init_pid) / "cgroup").read_text().splitlines()
        except OSError:
            return None
        candidates: list[Path] = []
        for line in lines:
            _, controllers, path = line.split(":", 2)
            rel = path.lstrip("/")
            if controllers == "":  # the unified (v2) hierarchy: alone, or beside v1 ("hybrid")
                candidates += [self.cgroup_root / rel, self.cgroup_root / "unified" / rel]
            elif "memory" in controllers.split(",") or "pids" in controllers.split(","):
                candidates.insert(0, self.cgroup_root / controllers / rel)
        for cand in candidates:
            procs = cand / "cgroup.procs"
            try:
                if str(init_pid) in procs.read_text().split():
                    return procs
            except OSError:
                continue
        return None

    def read_pidfile(self, init_pid: int, path: str) -> int | None:
        """An in-container pidfile, through the init's root (the container's filesystem)."""
        try:
            text = (self.proc / str(init_pid) / "root" / path.lstrip("/")).read_text().strip()
            return int(text) if text else None
        except (OSError, ValueError):
            return None

    def _read(self, host_pid: int) -> _Proc | None:
        base = self.proc / str(host_pid)
        try:
            stat = (base / "stat").read_text()
            status = (base / "status").read_text()
        except OSError:
            return None  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # comm may hold spaces and parentheses
        ppid, pgrp = int(fields[1]), int(fields[2])
        ns_pid, rss, hwm = host_pid, 0, 0
        for line in status.splitlines():
            if line.startswith("NSpid:"):
                ns_pid = int(line.split()[-1])  # the innermost namespace: the container's
            elif line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) * 1024
        return _Proc(host_pid=host_pid, ns_pid=ns_pid, ppid=ppid, pgrp=pgrp, rss_bytes=rss, hwm_bytes=hwm)

    def _pss(self, host_pid: int) -> int:
        try:
            for line in (self.proc / str(host_pid) / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def _socket_named(self, host_pid: int) -> str | None:
        """The PATH of ``--socket PATH`` on the process's command line, if any."""
        try:
            argv = (self.proc / str(host_pid) / "cmdline").read_bytes().split(b"\0")
        except OSError:
            return None
        return next((os.fsdecode(b) for a, b in zip(argv, argv[1:]) if a == b"--socket"), None)

    def _own_memory(self, members: Mapping[int, _Proc]) -> list[_Proc]:
        """The tree's processes that hold memory of their own, each as read once the kernel said so.

        A spawn before its exec is left out. A child of the tree is asked about first and read
        again after: its first reading may have been taken while it still ran in its parent's
        address space, and a kcmp that says "own" a moment later (it has exec'd since) does not
        make that reading its own. The CI load test's sampler counted a Kilo turn's spawn as a
        second 539 MiB Kilo that way (stop 42). An exec is one-way, so a reading taken after the
        kernel's "own" is the child's."""
        own: list[_Proc] = []
        for p in members.values():
            if p.ppid in members:
                if self.same_vm(p.ppid, p.host_pid):
                    continue
                again = self._read(p.host_pid)
                if again is None or again.ppid != p.ppid:
                    continue  # it exited (or its pid is another process's now)
                own.append(again)
            else:
                own.append(p)
        return own

    def measure(self, init_pid: int, pgids: set[int], *, pss: bool = True,
                relays: Mapping[int, str] | None = None) -> dict[int, GroupMemory]:
        """Memory of each named in-container process group (missing groups are left out).
        ``pss=False``: ``pss_bytes`` is 0, unread (``smaps_rollup`` walks every mapping of
        every process: most of a reading's cost for Node CLIs). ``relays``: pgid -> its keeper's
        socket; a process outside every named group whose command line names that socket
        (``--socket PATH``) is counted with the group, with its descendants."""
        procs_file = self.cgroup_procs_file(init_pid)
        if procs_file is None:
            return {}
        try:
            host_pids = [int(p) for p in procs_file.read_text().split()]
        except OSError:
            return {}
        procs = [p for p in (self._read(pid) for pid in host_pids) if p is not None]
        by_ns = {p.ns_pid: p for p in procs}
        children: dict[int, list[_Proc]] = {}
        for p in procs:
            children.setdefault(p.ppid, []).append(p)
        leaders = {pgid: by_ns[pgid] for pgid in pgids
                   if pgid in by_ns and by_ns[pgid].pgrp == by_ns[pgid].host_pid}  # else gone, or a reused pid
        grouped = {leader.host_pid for leader in leaders.values()}
        # only processes of no named group can be relays: a keeper's own tree never reads as one;
        # each one's command line is read once, whatever the number of groups
        relayed: dict[str, list[_Proc]] = {}
        if relays:
            for p in procs:
                if p.pgrp not in grouped and p.ns_pid != 1 and (named := self._socket_named(p.host_pid)):
                    relayed.setdefault(named, []).append(p)
        out: dict[int, GroupMemory] = {}
        for pgid, leader in leaders.items():
            members = {p.host_pid: p for p in procs if p.pgrp == leader.host_pid}
            socket = (relays or {}).get(pgid)
            if socket:
                members.update({p.host_pid: p for p in relayed.get(socket, [])})
            todo = list(members.values())
            while todo:
                for child in children.get(todo.pop().host_pid, []):
                    if child.host_pid not in members:
                        members[child.host_pid] = child
                        todo.append(child)
            own = self._own_memory(members)
            rss = sum(p.rss_bytes for p in own)
            hwm = sum(max(p.hwm_bytes, p.rss_bytes) for p in own)
            pss_bytes = sum(self._pss(p.host_pid) for p in own) if self.pss and pss else 0
            out[pgid] = GroupMemory(pgid=pgid, pids=len(members), rss_bytes=rss, pss_bytes=pss_bytes, hwm_bytes=hwm)
        return out


def host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
