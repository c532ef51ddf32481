"""Prometheus text exposition of turn outcomes and timings."""

from __future__ import annotations

from datetime import UTC, datetime

from runner.metrics import Metrics
from state.receipts import ContextStatus, Outcome, Receipt, Timings


def receipt(status: ContextStatus | None, outcome: Outcome, reason: str | None = None, total: int = 120) -> Receipt:
    now = datetime.now(UTC)
    return Receipt(job_id="j", user_id="u", chat_id="c", member_id="m", runtime="pi", context_status=status,
                   outcome=outcome, reason=reason, timings_ms=Timings(sandbox=5, process=60, turn=50, total=total),
                   started_at=now, finished_at=now)


def test_counters_histograms_and_gauges() -> None:
    m = Metrics()
    m.observe(receipt(ContextStatus.NEW, Outcome.SUCCEEDED, total=900))
    m.observe(receipt(ContextStatus.LIVE, Outcome.SUCCEEDED, total=40))
    m.observe(receipt(ContextStatus.LIVE, Outcome.FAILED, "context_too_long", total=40))
    m.observe(receipt(ContextStatus.LOST, Outcome.REFUSED, "container_missing", total=8))
    text = m.render(residents=2, sandboxes={"running": 1, "lost": 1}).splitlines()
    assert 'cloud_agent_turns_total{runtime="pi",status="LIVE",outcome="succeeded"} 1' in text
    assert 'cloud_agent_turns_total{runtime="pi",status="LIVE",outcome="failed"} 1' in text
    assert 'cloud_agent_refusals_total{runtime="pi",reason="container_missing"} 1' in text
    assert 'cloud_agent_failures_total{runtime="pi",reason="context_too_long"} 1' in text
    assert 'cloud_agent_turn_phase_ms_bucket{runtime="pi",phase="total",le="10"} 1' in text
    assert 'cloud_agent_turn_phase_ms_bucket{runtime="pi",phase="total",le="50"} 3' in text
    assert 'cloud_agent_turn_phase_ms_bucket{runtime="pi",phase="total",le="1000"} 4' in text
    assert 'cloud_agent_turn_phase_ms_bucket{runtime="pi",phase="total",le="+Inf"} 4' in text
    assert 'cloud_agent_turn_phase_ms_sum{runtime="pi",phase="total"} 988' in text
    assert "cloud_agent_resident_processes 2" in text
    assert 'cloud_agent_sandboxes{state="lost"} 1' in text
    assert text.count("# TYPE cloud_agent_turns_total counter") == 1


def test_label_values_are_escaped() -> None:
    m = Metrics()
    m.observe(receipt(ContextStatus.LOST, Outcome.REFUSED, 'we"ird\\reason'))
    assert 'cloud_agent_refusals_total{runtime="pi",reason="we\\"ird\\\\reason"} 1' in m.render(
        residents=0, sandboxes={}).splitlines()
