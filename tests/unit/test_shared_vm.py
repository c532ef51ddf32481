"""A spawn before its exec runs in its parent's address space (glibc's posix_spawn, libuv's and
Bun's spawns): /proc shows it with its parent's RSS to the byte. kcmp tells it apart, and a
group's reading counts its memory once (the CI load test's sampler read a Kilo turn's spawn
as a second Kilo, 2 × 579 MiB). Real processes of this host, real kernel."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
child = os.posix_spawn(sys.argv[2], sys.argv[2:], os.environ,
                       file_actions=[(os.POSIX_SPAWN_OPEN, 0, sys.argv[1], os.O_RDONLY, 0)])
os.waitpid(child, 0)
"""


def rss(pid: int) -> int:
    line = next(x for x in open(f"/proc/{pid}/status").read().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def release(fifo: Path) -> None:
    """The child's open of the FIFO returns: it execs its program."""
    try:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    except OSError as exc:  # released already: nobody reads the FIFO any more
        assert exc.errno == errno.ENXIO, exc


@contextmanager
def spawn_waiting(fifo: Path, program: list[str]) -> Iterator[tuple[int, int]]:
    """(parent, child): a group leader whose spawn waits before it execs ``program`` until
    ``release(fifo)``."""
    os.mkfifo(fifo)
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(fifo), *program], stdout=subprocess.PIPE,
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
        release(fifo)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)


@pytest.fixture
def spawning(tmp_path) -> Iterator[tuple[int, int]]:
    with spawn_waiting(tmp_path / "fifo", ["/bin/true"]) as pair:
        yield pair


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


def test_a_spawn_that_execs_between_its_reading_and_the_kernels_answer_is_read_again(tmp_path) -> None:
    """The race of stop 42's CI: the group's processes are read, the spawn execs, then kcmp says
    "own address space". The first reading was still the parent's (to the byte); counting it
    read a Kilo turn's spawn as a second 539 MiB Kilo. The reading that counts is taken after
    the kernel's answer."""
    fifo = tmp_path / "fifo"
    with spawn_waiting(fifo, ["/bin/sleep", "30"]) as (parent, child):
        alone = rss(parent)
        assert rss(child) == alone

        def execs_then_asks(a: int, b: int) -> bool:
            release(fifo)  # the spawn execs now, after the reader has read it
            deadline = time.monotonic() + 10
            while same_vm(a, b) and time.monotonic() < deadline:
                time.sleep(0.005)
            answer = same_vm(a, b)
            asked.append((a, b, answer))
            return answer

        asked: list[tuple[int, int, bool]] = []
        group = ProcMemory(pss=False, shares_vm=execs_then_asks).measure(parent, {parent})[parent]
        assert asked == [(parent, child, False)]
        assert group.pids == 2
        # the parent's memory once, and the sleep's own few MiB: not twice the parent's
        assert alone <= group.rss_bytes < alone + 16 * 1024 * 1024, (group.rss_bytes, alone)
