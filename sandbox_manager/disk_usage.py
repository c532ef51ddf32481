"""A sandbox's disk use where the storage driver has no quota (SPEC section 13).

overlay2 takes ``--storage-opt size`` only over xfs mounted with ``pquota``; elsewhere (this
machine: overlay2 on ext4) the engine refuses it, and the bound is a measured limit: a scan
of the container's writable layer (``GraphDriver.Data.UpperDir``) and of the chat's state
volume (its ``Mountpoint``: the workspace and native state, SPEC 15) from the host. The scan is
bounded — it stops as soon as the limit is passed or after ``max_entries`` entries, which
then counts as over the limit (millions of files are a disk problem of their own) — so one
sandbox's tree can never make the scan itself expensive. Blocking: call it in a worker thread.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

MAX_ENTRIES = 1_000_000


@dataclass(frozen=True)
class DiskUsage:
    bytes: int  # allocated blocks (sparse files count what they really take)
    entries: int
    over: bool
    why: str = ""


def scan(path: str, limit_bytes: int, *, max_entries: int = MAX_ENTRIES) -> DiskUsage:
    total = 0
    entries = 0
    seen: set[tuple[int, int]] = set()  # hard links count once
    stack = [path]
    while stack:
        current = stack.pop()
        try:
            it = os.scandir(current)
        except OSError:
            continue  # removed meanwhile, or unreadable: count what can be counted
        with it:
            for entry in it:
                entries += 1
                if entries > max_entries:
                    return DiskUsage(total, entries, True, f"more than {max_entries} files")
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    stack.append(entry.path)
                elif st.st_nlink > 1:
                    if (st.st_dev, st.st_ino) in seen:
                        continue
                    seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
                if total > limit_bytes:
                    return DiskUsage(total, entries, True, f"over {limit_bytes // (1024 * 1024)} MiB")
    return DiskUsage(total, entries, False)


def scan_all(paths: list[str], limit_bytes: int, *, max_entries: int = MAX_ENTRIES) -> DiskUsage:
    """One bound over several trees (a writable layer and a state volume): their sum."""
    total = entries = 0
    for path in paths:
        part = scan(path, limit_bytes - total, max_entries=max_entries - entries)
        total, entries = total + part.bytes, entries + part.entries
        if part.over:
            why = (f"more than {max_entries} files" if entries > max_entries
                   else f"over {limit_bytes // (1024 * 1024)} MiB")
            return DiskUsage(total, entries, True, why)
    return DiskUsage(total, entries, False)
