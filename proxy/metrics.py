"""The proxy's Prometheus metrics.

``ProxyMetrics`` counts what the proxy answers; it lives where the :class:`ProxyHost` runs (the
proxy service's process, or the daemon's). ``VerdictMetrics`` counts the wire verdicts, which
the daemon computes when it settles a turn, on the daemon's own registry.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ProxyMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("cloud_agent_proxy_requests", "Requests answered by the model proxy",
                                ["route", "status"], registry=self.registry)
        self.denied = Counter("cloud_agent_proxy_denied", "Requests refused by the allow-list (403)",
                              ["reason"], registry=self.registry)
        self.rejected = Counter("cloud_agent_proxy_rejected",
                                "Requests the proxy answered itself or broke off (bad input, upstream errors)",
                                ["reason"], registry=self.registry)
        self.bytes = Counter("cloud_agent_proxy_body_bytes", "Body bytes through the proxy",
                             ["direction"], registry=self.registry)
        self.audited_messages = Counter(
            "cloud_agent_proxy_audited_messages",
            "Conversation messages of audited requests: walked, or remembered from the member's last request",
            ["how"], registry=self.registry)

    def audited(self, walked: int, remembered: int) -> None:
        if walked:
            self.audited_messages.labels(how="walked").inc(walked)
        if remembered:
            self.audited_messages.labels(how="remembered").inc(remembered)


class VerdictMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.verdicts = Counter("cloud_agent_wire_verdicts", "Wire verdicts of settled turns",
                                ["runtime", "history"], registry=self.registry)

    def observe(self, runtime: str, history: str) -> None:
        self.verdicts.labels(runtime=runtime, history=history).inc()
