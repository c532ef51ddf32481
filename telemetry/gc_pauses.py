"""The garbage collector's pauses, as a histogram on the daemon's registry (issue 16).

A collection stops the event loop: every turn and request in flight waits for it. The soak found
the daemon's full collections at 70-90 ms (runner.heap freezes start-up's objects since; they
take under 8 ms). This keeps the pauses in sight in production:
``cloud_agent_gc_pause_seconds{generation}``. A collection runs under the GIL from its start
callback to its stop callback, so two never interleave and one start time suffices.

Process entry points only (``cloud-agent serve``, and ``runner.proxy_service`` under its own
name, which the daemon's /metrics relays), as ``runner.heap``: the callback is the process's,
and a test process running several daemons would count each collection once per daemon.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5)
DAEMON = "cloud_agent_gc_pause_seconds"
PROXY_SERVICE = "cloud_agent_proxy_gc_pause_seconds"  # the model proxy service's process
_WHOSE = {DAEMON: "the daemon's", PROXY_SERVICE: "the model proxy service's"}


class GcPauses:
    def __init__(self, registry: CollectorRegistry, name: str = DAEMON) -> None:
        self.histogram = Histogram(name, f"Pauses of the cyclic garbage collector in {_WHOSE[name]} process (its "
                                   "event loop stopped), by generation",
                                   ["generation"], buckets=BUCKETS, registry=registry)
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.histogram.labels(str(info["generation"])).observe(time.perf_counter() - self._started)

    def install(self) -> GcPauses:
        gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)
