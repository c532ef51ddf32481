"""The WAL flusher (state.wal_flusher): a process of its own fsyncs the store's relaxed commits.

Real processes and a real file: the flusher's child is started as the store starts it.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import anyio
import pytest

import state.store
from state.contract import StoreUnavailable
from state.records import SandboxState
from state.store import Store
from state.wal_flush_child import flush as fsync_first_of
from state.wal_flusher import FlusherGone, FlushFailed, WalFlusher
from tests.support.store import sandbox_record

pytestmark = pytest.mark.anyio


async def test_a_deferred_claim_is_asked_to_reach_the_disk_as_it_returns(sqlite_store: Store) -> None:
    store = sqlite_store
    """The claim's flush starts with the claim, not when the turn first waits for it; the wait
    then takes that flush rather than asking for another."""
    await store.open()
    assert store.flusher is not None and store.flusher.pid is not None
    claim = await store.claim_job("j1", "u", "c", "m", "d", "o", sync=False)
    assert claim.kind == "claimed"
    assert (store.flusher.sent, store.flusher.flushes) == (1, 0)
    await store.sync()
    assert (store.flusher.sent, store.flusher.flushes) == (1, 1)
    await store.sync()  # nothing new since: no flush asked for
    assert (store.flusher.sent, store.flusher.flushes) == (1, 1)


async def test_commits_made_while_a_flush_is_in_flight_share_the_next_one(tmp_path: Path) -> None:
    """One flush in flight at a time; the commits counted meanwhile all go with the next."""
    (tmp_path / "f").write_bytes(b"x")
    flusher = WalFlusher([str(tmp_path / "f")])
    try:
        for _ in range(5):
            flusher.committed(flush=True)
        assert flusher.sent == 1  # the first is in flight: the other four wait for it to answer
        async with anyio.create_task_group() as tg:  # several waiters: one reads, the rest follow
            for _ in range(3):
                tg.start_soon(flusher.wait)
        assert (flusher.sent, flusher.flushes) == (2, 2)
    finally:
        flusher.close()


async def test_the_flusher_inherits_no_environment_and_ends_with_the_store(tmp_path: Path) -> None:
    os.environ["CLOUD_AGENT_TEST_SECRET"] = "not-for-the-flusher"
    try:
        s = Store(tmp_path / "s.db")
        await s.open()
    finally:
        del os.environ["CLOUD_AGENT_TEST_SECRET"]
    assert s.flusher is not None and s.flusher.pid is not None
    pid = s.flusher.pid
    assert Path(f"/proc/{pid}/environ").read_bytes() == b""
    s.close()
    assert not Path(f"/proc/{pid}").exists()  # ended and reaped


async def test_a_flusher_that_ended_leaves_the_flush_to_a_thread(sqlite_store: Store, monkeypatch) -> None:
    """Each relaxed commit is then flushed on a thread, once: a sync with nothing new since
    fsyncs nothing (every response of the daemon asks, runner.durable_responses)."""
    store = sqlite_store
    await store.open()
    assert store.flusher is not None and store.flusher.pid is not None
    fsyncs: list[list[str]] = []
    monkeypatch.setattr(state.store, "fsync_first_of", lambda paths: (fsyncs.append(paths), fsync_first_of(paths)))
    pid = store.flusher.pid
    os.kill(pid, signal.SIGKILL)
    while Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z":  # dead, its socket closed
        await anyio.sleep(0.01)
    await store.claim_job("j1", "u", "c", "m", "d", "o", sync=False)
    await store.sync()  # flushed on a thread instead: it returns
    assert store.flusher.gone is not None and store.flusher.gone.startswith("send failed: BrokenPipeError")
    assert len(fsyncs) == 1
    await store.sync()
    await store.sync()
    assert len(fsyncs) == 1  # nothing committed since
    await store.claim_job("j2", "u", "c", "m", "d", "o", sync=False)
    await store.sync()
    assert len(fsyncs) == 2
    with pytest.raises(FlusherGone):
        await store.flusher.wait()


async def test_a_failed_fsync_fails_the_wait_and_the_store_says_it_is_unavailable(sqlite_store: Store) -> None:
    store = sqlite_store
    # procfs files refuse fsync (EINVAL): the child answers that the flush failed
    failing = WalFlusher(["/proc/version"])
    try:
        failing.committed(flush=True)
        with pytest.raises(FlushFailed):
            await failing.wait()
    finally:
        failing.close()
    store.flusher.close()
    store.flusher = WalFlusher(["/proc/version"])
    await store.claim_job("j1", "u", "c", "m", "d", "o", sync=False)
    with pytest.raises(StoreUnavailable, match="did not reach the disk"):
        await store.sync()


def test_the_flusher_ends_quietly_when_the_store_closes_with_an_answer_unread(tmp_path: Path) -> None:
    """Closing a socket with unread bytes resets it: the child's next read then fails with
    ECONNRESET, which ends it like the end of its input (it printed a traceback and exited 1)."""
    import select
    import socket
    import subprocess
    import sys

    from state.wal_flusher import CHILD

    (tmp_path / "f").write_bytes(b"x")
    parent, child = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-I", "-S", CHILD, str(tmp_path / "f")], stdin=child,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    child.close()
    parent.send(b"f")
    assert select.select([parent], [], [], 10)[0] == [parent]  # answered, and not read
    parent.close()
    _, err = proc.communicate(timeout=10)
    assert (proc.returncode, err) == (0, b"")


async def test_a_started_sandbox_is_marked_running_without_a_flush_of_its_own(sqlite_store: Store) -> None:
    """The record a RESTORED turn writes between the engine's start and the CLI's launch is
    committed, and goes to disk with the next flush (the turn's commit): it waited for its
    own fsync there."""
    store = sqlite_store
    await store.open()
    await store.put_sandbox(sandbox_record())
    await store.set_sandbox_state("u", "c", SandboxState.STOPPED)
    assert store.flusher is not None
    made, sent = store.flusher.made, store.flusher.sent
    await store.touch_sandbox("u", "c")
    assert (await store.get_sandbox("u", "c")).state == SandboxState.RUNNING
    assert (store.flusher.made, store.flusher.sent) == (made + 1, sent)  # committed, no flush asked
    await store.sync()
    assert (store.flusher.sent, store.flusher.flushes) == (sent + 1, 1)
