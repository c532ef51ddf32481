"""A spawn before its exec runs in its parent's address space (glibc's posix_spawn, libuv's and
Bun's spawns): /proc shows it with its parent's RSS to the byte. kcmp tells it apart, and a
group's reading counts its memory once (the CI load test's sampler read a Kilo turn's spawn
as a second Kilo, 2 × 579 MiB). Real processes of this host, real kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from sandbox_manager.proc_memory import ProcMemory
from sandbox_manager.shared_vm import same_vm

# 64 MiB touched, then a spawn whose child blocks opening a FIFO: between its clone and its exec
PARENT = """
import os, sys
blob = bytearray(64 * 1024 * 1024)
for i in range(0, len(blob), 4096):
    blob[i] = 1
print("ready", flush=True)
child = os.posix_spawn("/bin/true", ["true"], os.environ,
                       file_actions=[(os.POSIX_SPAWN_OPEN, 0, sys.argv[1], os.O_RDONLY, 0)])
os.waitpid(child, 0)
"""


def rss(pid: int) -> int:
    line = next(x for x in open(f"/proc/{pid}/status").read().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


@pytest.fixture
def spawning(tmp_path) -> Iterator[tuple[int, int]]:
    """(parent, child): a group leader whose spawn waits before its exec until the test lets it go."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(fifo)], stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 10
        children: list[str] = []
        while not children and time.monotonic() < deadline:
            children = open(f"/proc/{parent.pid}/task/{parent.pid}/children").read().split()
            time.sleep(0.01)
        assert len(children) == 1, children
        yield parent.pid, int(children[0])
    finally:
        with open(fifo, "w"):  # the child's open returns: it execs /bin/true and ends
            pass
        parent.wait(timeout=10)


def test_a_spawn_before_its_exec_shares_its_parents_address_space(spawning) -> None:
    parent, child = spawning
    assert rss(child) == rss(parent)  # what /proc shows: the parent's, to the byte
    assert same_vm(parent, child) is True
    assert same_vm(parent, os.getpid()) is False
    assert same_vm(parent, 999_999_999) is False  # gone


def test_a_groups_reading_counts_a_spawn_before_its_exec_once(spawning) -> None:
    parent, _ = spawning
    alone = rss(parent)
    assert alone > 64 * 1024 * 1024
    group = ProcMemory(pss=True).measure(parent, {parent})[parent]
    assert (group.pids, group.rss_bytes, group.hwm_bytes >= alone) == (2, alone, True)
    assert 0 < group.pss_bytes <= alone
    # without the kernel's answer the same group read as twice its memory
    naive = ProcMemory(pss=False, shares_vm=lambda a, b: False).measure(parent, {parent})[parent]
    assert (naive.pids, naive.rss_bytes) == (2, 2 * alone)
