"""The collector's pauses on the daemon's registry (telemetry/gc_pauses.py): each collection
observed once, under its generation, while installed, and none after."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from telemetry.gc_pauses import GcPauses


def counts(registry: CollectorRegistry) -> dict[str, float]:
    return {s.labels["generation"]: s.value for m in registry.collect() for s in m.samples
            if s.name == "cloud_agent_gc_pause_seconds_count"}


def test_each_collection_is_observed_under_its_generation_while_installed() -> None:
    registry = CollectorRegistry()
    pauses = GcPauses(registry).install()
    try:
        gc.collect(2)
        gc.collect(1)
        gc.collect(2)
    finally:
        pauses.remove()
    after = counts(registry)
    # automatic young collections may come in between: the explicit ones are counted exactly
    assert after["2"] == 2 and after["1"] >= 1, after
    total = next(s.value for m in registry.collect() for s in m.samples
                 if s.name == "cloud_agent_gc_pause_seconds_sum" and s.labels["generation"] == "2")
    assert 0 < total < 5
    gc.collect(2)  # removed: not counted
    assert counts(registry)["2"] == 2 and pauses not in gc.callbacks
