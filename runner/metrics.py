"""Prometheus metrics (text exposition format 0.0.4), kept in-process.

Turns by runtime/status/outcome, refusals and failures by reason, where turn time went
(sandbox, process, turn, total) as histograms, live resident processes and retained
sandboxes. No client library: a few counters and fixed buckets are all a scraper needs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from state.receipts import Outcome, Receipt

BUCKETS_MS = (10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000, 300000)
PHASES = ("sandbox", "process", "turn", "total")


def _labels(**kv: str) -> str:
    inner = ",".join(f'{k}="{str(v).replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"'
                     for k, v in kv.items())
    return "{" + inner + "}"


@dataclass
class Histogram:
    counts: list[int] = field(default_factory=lambda: [0] * len(BUCKETS_MS))
    total: int = 0
    sum_ms: float = 0.0

    def observe(self, ms: float) -> None:
        self.total += 1
        self.sum_ms += ms
        for i, bound in enumerate(BUCKETS_MS):
            if ms <= bound:
                self.counts[i] += 1


@dataclass
class Metrics:
    turns: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    refusals: Counter[tuple[str, str]] = field(default_factory=Counter)
    failures: Counter[tuple[str, str]] = field(default_factory=Counter)
    timings: dict[tuple[str, str], Histogram] = field(default_factory=dict)

    def observe(self, receipt: Receipt) -> None:
        runtime = receipt.runtime
        status = receipt.context_status.value if receipt.context_status else "none"
        self.turns[(runtime, status, receipt.outcome.value)] += 1
        if receipt.outcome == Outcome.REFUSED:
            self.refusals[(runtime, receipt.reason or "unknown")] += 1
        elif receipt.outcome in (Outcome.FAILED, Outcome.NOT_SETTLED):
            self.failures[(runtime, receipt.reason or "unknown")] += 1
        for phase in PHASES:
            hist = self.timings.setdefault((runtime, phase), Histogram())
            hist.observe(getattr(receipt.timings_ms, phase))

    def render(self, *, residents: int, sandboxes: dict[str, int]) -> str:
        out: list[str] = []

        def family(name: str, kind: str, help_: str) -> None:
            out.append(f"# HELP {name} {help_}")
            out.append(f"# TYPE {name} {kind}")

        family("cloud_agent_turns_total", "counter", "Turns by runtime, context status and outcome.")
        for (runtime, status, outcome), n in sorted(self.turns.items()):
            out.append(f"cloud_agent_turns_total{_labels(runtime=runtime, status=status, outcome=outcome)} {n}")
        family("cloud_agent_refusals_total", "counter", "Refused turns by runtime and reason.")
        for (runtime, reason), n in sorted(self.refusals.items()):
            out.append(f"cloud_agent_refusals_total{_labels(runtime=runtime, reason=reason)} {n}")
        family("cloud_agent_failures_total", "counter", "Failed and not-settled turns by runtime and reason.")
        for (runtime, reason), n in sorted(self.failures.items()):
            out.append(f"cloud_agent_failures_total{_labels(runtime=runtime, reason=reason)} {n}")
        family("cloud_agent_turn_phase_ms", "histogram", "Where turn time went, in milliseconds.")
        for (runtime, phase), h in sorted(self.timings.items()):
            for bound, count in zip(BUCKETS_MS, h.counts, strict=True):
                out.append(f"cloud_agent_turn_phase_ms_bucket{_labels(runtime=runtime, phase=phase, le=str(bound))} "
                           f"{count}")
            out.append(f"cloud_agent_turn_phase_ms_bucket{_labels(runtime=runtime, phase=phase, le='+Inf')} {h.total}")
            out.append(f"cloud_agent_turn_phase_ms_sum{_labels(runtime=runtime, phase=phase)} {h.sum_ms:g}")
            out.append(f"cloud_agent_turn_phase_ms_count{_labels(runtime=runtime, phase=phase)} {h.total}")
        family("cloud_agent_resident_processes", "gauge", "Live resident CLI processes.")
        out.append(f"cloud_agent_resident_processes {residents}")
        family("cloud_agent_sandboxes", "gauge", "Retained sandboxes by state.")
        for state, n in sorted(sandboxes.items()):
            out.append(f"cloud_agent_sandboxes{_labels(state=state)} {n}")
        return "\n".join(out) + "\n"
