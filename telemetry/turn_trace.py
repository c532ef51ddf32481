"""Per-phase timestamps of one turn (issue 16): a bench mode, never a production cost.

A trace exists only when a test or bench installs a sink (``TestHooks.turn_trace``): the
supervisor then begins one per submitted job and every layer of the turn path calls
:func:`mark` at its phase boundaries. The trace travels in a context variable, so it
reaches the job's task (started from the submitting context), the daemon's NDJSON
framing (the same request context) and the sandbox manager without widening any
signature. With no trace begun, :func:`mark` is one context-variable read.

Marks are ``time.perf_counter_ns()``: a bench in the same process compares them with its
own stamps (the CLI's stdout line as the transport reads it, the API client's line).
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass, field


@dataclass
class TurnTrace:
    job_id: str
    marks: list[tuple[str, int]] = field(default_factory=list)

    def mark(self, phase: str) -> None:
        self.marks.append((phase, time.perf_counter_ns()))

    def spans_ms(self) -> list[tuple[str, float]]:
        """Each phase with the milliseconds since the previous mark."""
        out = []
        for (_, prev), (phase, t) in zip(self.marks, self.marks[1:], strict=False):
            out.append((phase, (t - prev) / 1e6))
        return out


_current: ContextVar[TurnTrace | None] = ContextVar("turn_trace", default=None)


def begin(job_id: str) -> TurnTrace:
    """A trace for this job, current in this context and every task started from it."""
    trace = TurnTrace(job_id)
    _current.set(trace)
    trace.mark("submit")
    return trace


def mark(phase: str) -> None:
    trace = _current.get()
    if trace is not None:
        trace.mark(phase)
