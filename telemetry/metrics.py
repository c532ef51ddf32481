"""Shared metric helpers: one registry per daemon, exposition negotiated with the scraper.

A registry per daemon (not the library's process-global default) keeps several daemons in
one process, as the tests run them, from colliding on metric names.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder


def new_registry() -> CollectorRegistry:
    return CollectorRegistry(auto_describe=True)


def exposition(registry: CollectorRegistry, accept: str = "") -> tuple[bytes, str]:
    """The registry's samples in the format the ``Accept`` header asks for, and its content type
    (text format 0.0.4 unless the scraper asks for OpenMetrics or text 1.0.0)."""
    encode, content_type = choose_encoder(accept)
    return encode(registry), content_type
