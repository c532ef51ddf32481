"""Prometheus exposition of turn outcomes and timings (prometheus_client, one registry per daemon)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from prometheus_client.parser import text_string_to_metric_families

from runner.metrics import Metrics
from state.receipts import ContextStatus, Outcome, Receipt, Timings
from tests.support.metrics import sample


def receipt(status: ContextStatus | None, outcome: Outcome, reason: str | None = None, total: int = 120) -> Receipt:
    now = datetime.now(UTC)
    return Receipt(job_id="j", user_id="u", chat_id="c", member_id="m", runtime="pi", context_status=status,
                   outcome=outcome, reason=reason, timings_ms=Timings(sandbox=5, process=60, turn=50, total=total),
                   started_at=now, finished_at=now)


def render(m: Metrics, **kw) -> str:
    body, content_type = m.render(**({"residents": 0, "sandboxes": {}} | kw))
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    return body.decode()


def test_counters_histograms_and_gauges() -> None:
    m = Metrics()
    m.observe(receipt(ContextStatus.NEW, Outcome.SUCCEEDED, total=900))
    m.observe(receipt(ContextStatus.LIVE, Outcome.SUCCEEDED, total=40))
    m.observe(receipt(ContextStatus.LIVE, Outcome.FAILED, "context_too_long", total=40))
    m.observe(receipt(ContextStatus.LOST, Outcome.REFUSED, "container_missing", total=8))
    text = render(m, residents=2, sandboxes={"running": 1, "lost": 1})
    assert sample(text, "cloud_agent_turns_total", runtime="pi", status="LIVE", outcome="succeeded") == 1
    assert sample(text, "cloud_agent_turns_total", runtime="pi", status="LIVE", outcome="failed") == 1
    assert sample(text, "cloud_agent_turns_total", runtime="pi", status="NEW", outcome="succeeded") == 1
    assert sample(text, "cloud_agent_refusals_total", runtime="pi", reason="container_missing") == 1
    assert sample(text, "cloud_agent_failures_total", runtime="pi", reason="context_too_long") == 1
    assert sample(text, "cloud_agent_failures_total", runtime="pi", reason="container_missing") is None
    bucket = "cloud_agent_turn_phase_ms_bucket"
    assert sample(text, bucket, runtime="pi", phase="total", le="10.0") == 1
    assert sample(text, bucket, runtime="pi", phase="total", le="50.0") == 3
    assert sample(text, bucket, runtime="pi", phase="total", le="1000.0") == 4
    assert sample(text, bucket, runtime="pi", phase="total", le="+Inf") == 4
    assert sample(text, "cloud_agent_turn_phase_ms_sum", runtime="pi", phase="total") == 988
    assert sample(text, "cloud_agent_turn_phase_ms_count", runtime="pi", phase="sandbox") == 4
    assert sample(text, "cloud_agent_resident_processes") == 2
    assert sample(text, "cloud_agent_sandboxes", state="lost") == 1
    assert text.splitlines().count("# TYPE cloud_agent_turns_total counter") == 1
    types = {f.name: f.type for f in text_string_to_metric_families(text) if not f.name.endswith("_created")}
    assert types == {"cloud_agent_turns": "counter", "cloud_agent_refusals": "counter",
                     "cloud_agent_failures": "counter", "cloud_agent_turn_phase_ms": "histogram",
                     "cloud_agent_resident_processes": "gauge", "cloud_agent_sandboxes": "gauge"}


def test_label_values_are_escaped() -> None:
    m = Metrics()
    m.observe(receipt(ContextStatus.LOST, Outcome.REFUSED, 'we"ird\\reason'))
    text = render(m)
    assert 'reason="we\\"ird\\\\reason"' in text
    assert sample(text, "cloud_agent_refusals_total", runtime="pi", reason='we"ird\\reason') == 1


def test_each_daemon_has_its_own_registry() -> None:
    first, second = Metrics(), Metrics()  # the default global registry would raise "Duplicated timeseries"
    first.observe(receipt(ContextStatus.NEW, Outcome.SUCCEEDED))
    assert sample(render(first), "cloud_agent_turns_total", runtime="pi", status="NEW", outcome="succeeded") == 1
    assert sample(render(second), "cloud_agent_turns_total", runtime="pi", status="NEW", outcome="succeeded") is None


def test_the_scraper_chooses_the_format() -> None:
    m = Metrics()
    m.observe(receipt(ContextStatus.NEW, Outcome.SUCCEEDED))
    body, content_type = m.render(residents=0, sandboxes={}, accept="application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text; version=1.0.0")
    assert body.decode().endswith("# EOF\n")


@pytest.mark.anyio
async def test_the_daemons_metrics_are_one_registry_with_every_parts_families(tmp_path) -> None:
    """The supervisor's exposition holds its own families, the model proxy's, the capacity
    limits' and the memory budget's, each exactly once (one registry, no concatenated texts)."""
    import tempfile

    from runner.config import load_settings
    from runner.supervisor import build_supervisor
    from tests.support.fake_engine import FakeEngine

    sockets = tempfile.mkdtemp(prefix="ca-m-", dir="/tmp")
    settings = load_settings({"CLOUD_AGENT_HOME": str(tmp_path), "CLOUD_AGENT_SOCKET_DIR": sockets,
                              "CLOUD_AGENT_MAX_TURNS": "3", "CLOUD_AGENT_RESIDENT_MEMORY_MB": "2048"})
    sup = build_supervisor(settings, "http://127.0.0.1:9", engine=FakeEngine())  # type: ignore[arg-type]
    try:
        sup.model_path.verdict_metrics.observe("pi", "complete")
        body, content_type = await sup.render_metrics()
    finally:
        sup.store.close()
    assert content_type == "text/plain; version=0.0.4; charset=utf-8"
    text = body.decode()
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(families) == len(set(families)), sorted(f for f in families if families.count(f) > 1)
    for name in ("cloud_agent_turns_total", "cloud_agent_resident_processes", "cloud_agent_sandboxes",
                 "cloud_agent_proxy_requests_total", "cloud_agent_wire_verdicts_total", "cloud_agent_queue_depth",
                 "cloud_agent_turns_limit", "cloud_agent_resident_memory_budget_bytes"):
        assert name in families, (name, families)
    assert sample(text, "cloud_agent_wire_verdicts_total", runtime="pi", history="complete") == 1
    assert sample(text, "cloud_agent_turns_limit") == 3
    assert sample(text, "cloud_agent_resident_memory_budget_bytes") == 2048 * 1024 * 1024
