"""``python -m deploy.loopback [--host 127.0.0.1] [--port 0] [--record FILE.jsonl] [--script FILE.json] [--token-file F]``

Prints ``loopback listening on http://HOST:PORT`` as its first stdout line, then serves until
SIGTERM or SIGINT (or, with ``--exit-on-stdin-eof``, until its parent closes stdin or dies). The
control routes (``/_fixture/*``) need the control token: read from ``--token-file`` when that
file exists, else generated and written there (mode 0600); without the option it is generated
and kept in memory (control routes then unreachable: record and script files still work).
"""

from __future__ import annotations

import argparse
import secrets
import signal
import sys
import threading
from pathlib import Path

from telemetry.logs import configure_logging

from .server import LoopbackFixture


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deploy.loopback", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1", help="a loopback address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="0 = an ephemeral port")
    parser.add_argument("--record", metavar="FILE.jsonl", help="append every request to this JSONL file")
    parser.add_argument("--script", metavar="FILE.json", help='behaviour script: {"rules": [...]}')
    parser.add_argument("--token-file", metavar="FILE", help="the control routes' token (read, or written 0600)")
    parser.add_argument("--log-level", default="WARNING")
    parser.add_argument("--exit-on-stdin-eof", action="store_true",
                        help="stop when stdin closes (a parent that starts the fixture as its child)")
    args = parser.parse_args(argv)
    configure_logging(level=args.log_level)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    if args.exit_on_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()
    token = None
    if args.token_file:
        path = Path(args.token_file)
        if path.exists():
            token = path.read_text().strip()
        else:
            token = secrets.token_hex(24)
            path.touch(mode=0o600)
            path.write_text(token + "\n")
    fx = LoopbackFixture.start(args.host, args.port, record_path=args.record, script=args.script,
                               control_token=token)
    print(f"loopback listening on {fx.base_url}", flush=True)
    try:
        stop.wait()
    finally:
        fx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
