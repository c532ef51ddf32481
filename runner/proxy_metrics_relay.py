"""The model proxy service's counters on the daemon's registry (SPEC 11): one exposition for
the scraper, every family once.

The service counts requests by route and status, rejections, body bytes and its collector's
pauses in its own process (its counters outlive daemon restarts, and reset when the service is
replaced: a counter reset the scraper handles). Before each scrape the daemon asks it for a
snapshot; this collector yields the snapshot's samples under the families
:class:`proxy.ProxyMetrics` and the service's ``telemetry.gc_pauses`` declare, which it also
declares when no snapshot came (an idle or unreachable service: families without samples).
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from proxy import ProxyMetrics
from runner.proxy_protocol import MetricsResult
from telemetry.gc_pauses import PROXY_SERVICE, GcPauses


def _declared() -> list[Metric]:
    """The service's families, as this build declares them, without samples: the proxy's, and
    its process's collector pauses (the service's entry point installs them)."""
    registry = ProxyMetrics(CollectorRegistry()).registry
    GcPauses(registry, PROXY_SERVICE)  # declared, not installed: this process is the daemon
    return list(registry.collect())


class ProxyMetricsRelay(Collector):
    def __init__(self, registry: CollectorRegistry) -> None:
        self._declared = {m.name: m for m in _declared()}
        self._families: list[Metric] = list(self._declared.values())
        registry.register(self)

    def update(self, snapshot: MetricsResult | None) -> None:
        """The samples of ``snapshot`` from now on (None: none, the families stay declared)."""
        got = {f.name: f for f in snapshot.families} if snapshot is not None else {}
        families = []
        for name, declared in self._declared.items():
            metric = Metric(name, declared.documentation, declared.type, declared.unit)
            for s in got[name].samples if name in got else []:
                metric.add_sample(s.name, s.labels, s.value, s.timestamp)
            families.append(metric)
        self._families = families

    def describe(self) -> Iterable[Metric]:
        return list(self._declared.values())

    def collect(self) -> Iterable[Metric]:
        return list(self._families)
