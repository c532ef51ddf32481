"""The WAL flusher's process (state.wal_flusher): stdlib only, run by path with ``python -I -S``.

Its standard input is one end of a socket pair. Each byte received asks for one flush: the
first of the given files that exists is opened afresh and fsynced (the WAL, else the
database: with no WAL file every commit was checkpointed, and the checkpoint synced it), then
one byte answers — ``k`` when it is on disk, ``e`` when the fsync failed (the reason goes to
standard error). End of input ends the process, and so does a reset: a store that closes with
an answer it did not read resets the link (a turn's commit no longer waits for its flush, so
one may be in flight when the store closes).
"""

from __future__ import annotations

import os
import socket
import sys


def flush(paths: list[str]) -> None:
    """fsync the first of ``paths`` that exists, through a fresh descriptor (fsync is per file,
    whichever descriptor asks). Also the store's flush on a thread when there is no flusher."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return


def main(paths: list[str]) -> None:
    link = socket.socket(fileno=0)
    while True:
        try:
            asked = link.recv(64)
        except ConnectionResetError:
            return
        if not asked:
            return
        try:
            flush(paths)
            answer = b"k"
        except OSError as exc:
            print(f"wal flush failed: {exc!r}", file=sys.stderr, flush=True)
            answer = b"e"
        try:
            link.sendall(answer * len(asked))
        except (BrokenPipeError, ConnectionResetError):
            return


if __name__ == "__main__":
    main(sys.argv[1:])
