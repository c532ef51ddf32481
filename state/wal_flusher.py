"""Commits flushed to disk by a process of their own, asked the moment they return (issue 16).

A job's claim is committed with ``sync=False`` and must reach the disk before the CLI gets the
message (runner.claim_on_disk). Its fsync ran on a worker thread, and a thread needs the GIL
to start and to return: while the event loop prepared the turn (pure Python) the thread
waited for it, so the flush began only once the loop went idle, most of a millisecond after
the commit (measured in a LIVE turn: the fsync began 1.1 ms after it was asked for). A process
of its own needs no GIL. The store's thread asks for the flush as the commit returns (one byte
on a socket), the flusher (state.wal_flush_child) fsyncs while the loop prepares the turn, and
:meth:`WalFlusher.wait` reads its answer.

One flush is in flight at a time. It covers every commit counted before it was asked for, so
concurrent turns share flushes (a group commit). A flusher that cannot start or has gone
raises :class:`FlusherGone`: the store flushes on a thread as before.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import weakref
from pathlib import Path

import anyio

CHILD = str(Path(__file__).with_name("wal_flush_child.py"))


class FlusherGone(Exception):
    """The flusher process is not there (it could not start, or it ended)."""


class FlushFailed(OSError):
    """The flusher's fsync failed: the commits it covered may not be on disk."""


def _close(link: socket.socket, proc: subprocess.Popen[bytes]) -> None:
    link.close()  # the child reads its end of input and exits
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class WalFlusher:
    """``committed`` is called on the store's thread after each relaxed commit; ``wait`` on
    the event loop. Both are safe together (one lock guards the counts)."""

    def __init__(self, paths: list[str]) -> None:
        self._paths = paths
        self._lock = threading.Lock()
        self._link: socket.socket | None = None
        self._finalizer: weakref.finalize | None = None
        self._made = 0  # relaxed commits counted (each after its COMMIT returned)
        self._asked = 0  # commits a flush is wanted for
        self._flight: int | None = None  # commits the flush in flight covers
        self._done = 0  # commits known to be on disk
        self._reading = False
        self._answered: anyio.Event | None = None
        self.gone: str | None = None
        self.pid: int | None = None
        self.sent = 0  # flushes asked for
        self.flushes = 0  # answers read: each one fsync

    # -- either thread ------------------------------------------------------------------------

    @property
    def made(self) -> int:
        """Relaxed commits counted so far."""
        with self._lock:
            return self._made

    def start(self) -> None:
        """Start the process now (else at the first flush asked for)."""
        with self._lock:
            self._link_locked()

    def committed(self, *, flush: bool) -> None:
        """A relaxed commit returned; ``flush``: it is to reach the disk now, not at the next wait."""
        with self._lock:
            self._made += 1
            if flush:
                self._asked = self._made
                self._send_locked()

    def close(self) -> None:
        with self._lock:
            self.gone = self.gone or "closed"
            finalizer = self._finalizer
        if finalizer is not None:
            finalizer()

    def _link_locked(self) -> socket.socket | None:
        if self._link is None and self.gone is None:
            parent, child = socket.socketpair()
            try:
                # -I -S: no site, no environment, no working directory: the child is stdlib only,
                # and inherits none of the daemon's settings
                proc = subprocess.Popen([sys.executable, "-I", "-S", CHILD, *self._paths], stdin=child,
                                        stdout=subprocess.DEVNULL, close_fds=True, env={})
            except OSError as exc:
                parent.close()
                self.gone = f"could not start: {exc!r}"
                return None
            finally:
                child.close()
            parent.setblocking(False)
            self._link, self.pid = parent, proc.pid
            self._finalizer = weakref.finalize(self, _close, parent, proc)
        return self._link

    def _send_locked(self) -> None:
        if self._flight is not None or self._asked <= self._done or self.gone is not None:
            return
        link = self._link_locked()
        if link is None:
            return
        try:
            link.send(b"f")
        except OSError as exc:
            self.gone = f"send failed: {exc!r}"
            return
        self._flight = self._made  # every commit counted so far returned before this byte
        self.sent += 1

    # -- the event loop -----------------------------------------------------------------------

    async def wait(self) -> None:
        """Every relaxed commit counted so far is on disk when this returns. Raises
        :class:`FlushFailed` when the flush covering them failed, :class:`FlusherGone` when
        there is no flusher (the caller flushes another way)."""
        with self._lock:
            target = self._made
            self._asked = max(self._asked, target)
        while True:
            with self._lock:
                if self._done >= target:
                    return
                self._send_locked()
                if self.gone is not None:
                    raise FlusherGone(self.gone)
                reading = self._reading
                if not reading:
                    self._reading, self._answered = True, anyio.Event()
                answered = self._answered
            assert answered is not None
            if reading:  # another waiter reads the answer; then look again
                await answered.wait()
                continue
            try:
                await self._read_answer()
            finally:
                with self._lock:
                    self._reading = False
                answered.set()

    async def _read_answer(self) -> None:
        link = self._link
        assert link is not None
        while True:
            await anyio.wait_readable(link)
            try:
                answer = link.recv(1)
            except BlockingIOError:
                continue
            break
        with self._lock:
            covered, self._flight = self._flight, None
            if not answer:
                self.gone = "the flusher ended"
                raise FlusherGone(self.gone)
            self.flushes += 1
            if answer == b"k" and covered is not None:
                self._done = max(self._done, covered)
            self._send_locked()  # a flush asked for meanwhile goes now
        if answer != b"k":
            raise FlushFailed("the flusher's fsync failed (its reason is on the daemon's standard error)")
