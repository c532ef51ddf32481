"""Model proxy services (``python -m runner.proxy_service --home H``) a test session left behind.

A service outlives its daemon by design; the harness stops it when the daemon ends, except
after a ``kill -9`` (the next daemon attaches to it), and a failed test may leave one either
way. At the session's end every service whose home is one of the session's — a home its
daemons used, or any directory under its base temp dir — is ended; never another process.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def services() -> dict[int, Path]:
    """pid -> home of every proxy service process on this machine (read from /proc)."""
    found: dict[int, Path] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # gone meanwhile, or not ours to read
        if b"runner.proxy_service" in argv and b"--home" in argv:
            at = argv.index(b"--home") + 1
            if at < len(argv):
                found[int(entry.name)] = Path(os.fsdecode(argv[at]))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def end_strays(homes: set[Path], base: Path | None) -> list[int]:
    """SIGTERM (then SIGKILL after 10 s) the services of ``homes`` or homes under ``base``;
    returns their pids."""
    def ours(home: Path) -> bool:
        return home in homes or (base is not None and home.is_relative_to(base))

    pids = [pid for pid, home in services().items() if ours(home)]
    for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        if not any(_alive(p) for p in pids):
            break
    return pids
