"""Bench mode (issue 16): per-phase marks travel in a context variable, are absent unless a
trace was begun, and reach tasks started from the submitting context."""

from __future__ import annotations

import anyio
import pytest

from telemetry import turn_trace
from telemetry.turn_trace import TurnTrace, mark

pytestmark = pytest.mark.anyio


def test_no_trace_begun_marks_nothing() -> None:
    def fresh() -> TurnTrace | None:
        mark("anything")  # no trace in this context: a no-op, nothing raised
        return turn_trace._current.get()

    import contextvars

    assert contextvars.copy_context().run(fresh) is None


async def test_marks_reach_child_tasks_in_order() -> None:
    seen: list[TurnTrace] = []

    async def job() -> None:
        mark("locked")
        await anyio.sleep(0)
        mark("committed")

    async def submit() -> None:
        seen.append(turn_trace.begin("job-1"))
        mark("claimed")
        async with anyio.create_task_group() as tg:
            tg.start_soon(job)
        mark("receipt_framed")

    await submit()
    (trace,) = seen
    assert trace.job_id == "job-1"
    assert [p for p, _ in trace.marks] == ["submit", "claimed", "locked", "committed", "receipt_framed"]
    stamps = [t for _, t in trace.marks]
    assert stamps == sorted(stamps)
    assert [p for p, _ in trace.spans_ms()] == ["claimed", "locked", "committed", "receipt_framed"]
    assert all(ms >= 0 for _, ms in trace.spans_ms())
