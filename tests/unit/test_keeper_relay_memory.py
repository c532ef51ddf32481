"""A keeper's relay — the attached exec that carries the daemon's link to the keeper, in a session
of its own — is read with its resident's process group: it names the keeper's socket on its
command line (``ca-keeper run|attach --socket PATH``). Real processes of this host, real /proc."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator

import pytest

from sandbox_manager.proc_memory import GroupMemory, ProcMemory

# each holds 32 MiB touched, prints "ready" and waits for its stdin to end
HOLD = """
import sys
blob = bytearray(32 * 1024 * 1024)
for i in range(0, len(blob), 4096):
    blob[i] = 1
print("ready", flush=True)
sys.stdin.read()
"""


def rss(pid: int) -> int:
    line = next(x for x in open(f"/proc/{pid}/status").read().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def steady(expected: Callable[[], int], read: Callable[[], GroupMemory]) -> GroupMemory:
    """A reading taken while the processes' RSS stood still (read the same before and after it):
    a process that printed "ready" may still fault in a page or two on its way into its read."""
    for _ in range(50):
        before = expected()
        found = read()
        if expected() == before:
            return found
        time.sleep(0.05)
    raise AssertionError("the processes' RSS never stood still")


@pytest.fixture
def run() -> str:
    """A directory name of this test's own: relays are found by their command line, host-wide, and
    another test's relay of the same path (another xdist worker's, at the same moment) would
    count too."""
    return f"/run/t{uuid.uuid4().hex[:12]}"


@pytest.fixture
def processes(run: str) -> Iterator[dict[str, int]]:
    """A group leader (the keeper), its relay, and another member's relay: each a session of its own."""
    argvs = {"keeper": [], "relay": ["run", "--socket", f"{run}/a/keeper.sock", "--member", "a"],
             "other": ["attach", "--socket", f"{run}/b/keeper.sock"]}
    procs = {name: subprocess.Popen([sys.executable, "-c", HOLD, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    start_new_session=True) for name, args in argvs.items()}
    try:
        for p in procs.values():
            assert p.stdout is not None and p.stdout.readline() == b"ready\n"
        yield {name: p.pid for name, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)


def test_a_relay_naming_the_keepers_socket_is_read_with_its_group(processes, run) -> None:
    keeper, relay = processes["keeper"], processes["relay"]
    reader = ProcMemory(pss=False)
    alone = steady(lambda: rss(keeper), lambda: reader.measure(keeper, {keeper})[keeper])
    assert (alone.pids, alone.rss_bytes) == (1, rss(keeper))
    found = steady(lambda: rss(keeper) + rss(relay),
                   lambda: reader.measure(keeper, {keeper}, relays={keeper: f"{run}/a/keeper.sock"})[keeper])
    assert (found.pids, found.rss_bytes) == (2, rss(keeper) + rss(relay))
    assert found.rss_bytes > 64 * 1024 * 1024


def test_a_relay_of_another_socket_or_a_prefix_of_it_is_not(processes, run) -> None:
    keeper = processes["keeper"]
    reader = ProcMemory(pss=False)
    for socket in (f"{run}/c/keeper.sock", f"{run}/a/keeper", f"{run}/a/keeper.sock2"):
        found = steady(lambda: rss(keeper), lambda: reader.measure(keeper, {keeper}, relays={keeper: socket})[keeper])
        assert (found.pids, found.rss_bytes) == (1, rss(keeper)), socket
