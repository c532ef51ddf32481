"""Host capacity metrics (SPEC sections 11 and 13), with prometheus_client.

On the daemon's one registry (runner.metrics; tests run several daemons in one process).
Gauges that mirror live state read it when scraped, so they can never drift from it.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from telemetry.metrics import new_registry

WAIT_BUCKETS_S = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class CapacityMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else new_registry()
        r = self.registry
        self.queue_depth = Gauge("cloud_agent_queue_depth", "Jobs waiting for admission.", registry=r)
        self.queue_wait = Histogram("cloud_agent_queue_wait_seconds", "Time admitted jobs waited in the queue.",
                                    buckets=WAIT_BUCKETS_S, registry=r)
        self.host_busy = Counter("cloud_agent_host_busy", "Jobs answered 503 host_busy (nothing ran).", registry=r)
        self.turns_running = Gauge("cloud_agent_turns_admitted", "Admitted jobs (turn slots in use).", registry=r)
        self.turns_limit = Gauge("cloud_agent_turns_limit", "CLOUD_AGENT_MAX_TURNS (0: unlimited).", registry=r)
        self.sandboxes_running = Gauge("cloud_agent_sandboxes_running", "Sandboxes the daemon counts as running.",
                                       registry=r)
        self.sandboxes_limit = Gauge("cloud_agent_sandboxes_running_limit",
                                     "CLOUD_AGENT_MAX_RUNNING_SANDBOXES (0: unlimited).", registry=r)
        self.sandbox_stops = Counter("cloud_agent_sandbox_stops", "Sandboxes stopped by the daemon, by cause.",
                                     ["cause"], registry=r)
        self.sandbox_removals = Counter("cloud_agent_sandbox_removals", "Sandboxes removed by the daemon, by cause.",
                                        ["cause"], registry=r)

    def watch(self, *, depth: Callable[[], int], running: Callable[[], int], sandboxes: Callable[[], int]) -> None:
        self.queue_depth.set_function(depth)
        self.turns_running.set_function(running)
        self.sandboxes_running.set_function(sandboxes)
