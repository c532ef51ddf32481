"""The daemon's Prometheus metrics (SPEC 11), through ``prometheus_client``.

Turns by runtime/status/outcome, refusals and failures by reason, where turn time went
(sandbox, process, turn, total) as histograms, live resident processes and retained
sandboxes. Gauges are read from the supervisor's state at scrape time.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from state.receipts import Outcome, Receipt
from telemetry.metrics import exposition, new_registry

BUCKETS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000)
PHASES = ("sandbox", "process", "turn", "total")


class Metrics:
    def __init__(self) -> None:
        self.registry = new_registry()
        r = self.registry
        self.turns = Counter("cloud_agent_turns", "Turns by runtime, context status and outcome.",
                             ["runtime", "status", "outcome"], registry=r)
        self.refusals = Counter("cloud_agent_refusals", "Refused turns by runtime and reason.",
                                ["runtime", "reason"], registry=r)
        self.failures = Counter("cloud_agent_failures", "Failed and not-settled turns by runtime and reason.",
                                ["runtime", "reason"], registry=r)
        self.turn_phase_ms = Histogram("cloud_agent_turn_phase_ms", "Where turn time went, in milliseconds.",
                                       ["runtime", "phase"], buckets=BUCKETS_MS, registry=r)
        self.residents = Gauge("cloud_agent_resident_processes", "Live resident CLI processes.", registry=r)
        self.sandboxes = Gauge("cloud_agent_sandboxes", "Retained sandboxes by state.", ["state"], registry=r)

    def observe(self, receipt: Receipt) -> None:
        runtime = receipt.runtime
        status = receipt.context_status.value if receipt.context_status else "none"
        self.turns.labels(runtime=runtime, status=status, outcome=receipt.outcome.value).inc()
        if receipt.outcome == Outcome.REFUSED:
            self.refusals.labels(runtime=runtime, reason=receipt.reason or "unknown").inc()
        elif receipt.outcome in (Outcome.FAILED, Outcome.NOT_SETTLED):
            self.failures.labels(runtime=runtime, reason=receipt.reason or "unknown").inc()
        for phase in PHASES:
            self.turn_phase_ms.labels(runtime=runtime, phase=phase).observe(getattr(receipt.timings_ms, phase))

    def render(self, *, residents: int, sandboxes: dict[str, int], accept: str = "") -> tuple[bytes, str]:
        """Set the scrape-time gauges; return the exposition and its content type."""
        self.residents.set(residents)
        for state, n in sandboxes.items():
            self.sandboxes.labels(state=state).set(n)
        return exposition(self.registry, accept)
