"""Read a Prometheus exposition back into samples (label order and value formatting aside)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def sample(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample, or None when the exposition has no such series."""
    return samples(text).get((name, frozenset(labels.items())))
