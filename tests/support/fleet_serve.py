"""`cloud-agent serve` with the fleet tests' one seam: while the file named by
``CA_TEST_PAUSE_FILE`` exists, this host's lease heartbeat is paused (a partitioned host).

Test-only: the production daemon has no setting that reaches ``TestHooks.lease_paused``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import uvicorn

from runner.config import load_settings
from runner.serve import build_daemon
from runner.turn import TestHooks
from telemetry.logs import configure_logging


def main() -> int:
    configure_logging(json=True)
    pause = Path(os.environ["CA_TEST_PAUSE_FILE"])
    settings = load_settings()
    daemon = build_daemon(settings, hooks=TestHooks(lease_paused=pause.exists))
    config = uvicorn.Config(daemon.app, host=settings.listen_host, port=settings.listen_port, log_config=None,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=10)
    uvicorn.Server(config).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
