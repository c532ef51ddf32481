"""The default gateway of `cloud-agent serve` (SPEC 10): the loopback fixture as a child process.

The daemon module never imports the fixture (a test double); the CLI entry point starts it
with ``python -m deploy.loopback`` when CLOUD_AGENT_GATEWAY_URL is unset, and passes its URL
to the daemon like any other gateway. The fixture's control token (its ``/_fixture/*`` routes)
is kept in a 0600 file beside the record, for an operator or a test that reads what the fixture
saw; no sandbox can reach the fixture anyway (sealed). The child watches its stdin: when this process dies,
even by ``kill -9``, the pipe closes and the fixture exits with it.
"""

from __future__ import annotations

import re
import selectors
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_READY = re.compile(r"^loopback listening on (http://127\.0\.0\.1:\d+)$")


class LoopbackStartFailed(RuntimeError):
    pass


@contextmanager
def loopback_child(record_path: Path, token_path: Path, *, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Run the fixture until the block ends; yield its base URL."""
    argv = [sys.executable, "-m", "deploy.loopback", "--record", str(record_path), "--token-file", str(token_path),
            "--exit-on-stdin-eof"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            line = proc.stdout.readline() if sel.select(start_timeout_s) else ""
        ready = _READY.match(line.strip())
        if ready is None:
            raise LoopbackStartFailed(f"the loopback fixture did not start within {start_timeout_s}s "
                                      f"(exit {proc.poll()}, first line {line.strip()!r})")
        yield ready.group(1)
    finally:
        if proc.stdin is not None:
            proc.stdin.close()  # the fixture exits on EOF; terminate covers a stuck one
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
