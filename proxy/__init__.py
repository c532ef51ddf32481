"""The host-side model proxy and the wire audit (SPEC 7, 12; issue 12).

Knows HTTP and unix sockets only: no Docker, no drivers, no runner. The runner owns one
:class:`ProxyHost`, opens a socket per sandbox, gives each member's CLI
``member_base_url(port, member_key)`` and ``placeholder_key(chat_key)``, and turns each turn's
:class:`WireRecord` list into a :class:`WireVerdict` with :func:`wire_verdict`.
"""

from .classify import Kind, classify
from .config import ProxyConfig
from .digest import TextMessage, strip_annotations, text_messages
from .exchange import TurnLookup
from .host import SOCKET_NAME, ProxyHost
from .keys import KeySource, KeyUnavailable, placeholder_key
from .metrics import ProxyMetrics, VerdictMetrics
from .records import CapturedMessage, DigestEntry, WireRecord, WireSink, digest_of
from .routes import ROUTES, Route, member_base_url
from .verdict import (
    TOLERANCES,
    Baseline,
    FirstDifference,
    Tolerance,
    WireVerdict,
    baseline_after,
    tolerances_for,
    wire_verdict,
)

__all__ = [
    "ROUTES", "SOCKET_NAME", "TOLERANCES", "Baseline", "CapturedMessage", "DigestEntry", "FirstDifference", "Kind",
    "KeySource", "KeyUnavailable", "ProxyConfig", "ProxyHost", "ProxyMetrics", "Route", "TextMessage", "Tolerance",
    "TurnLookup", "VerdictMetrics", "WireRecord", "WireSink", "WireVerdict", "baseline_after", "classify", "digest_of",
    "member_base_url", "placeholder_key", "strip_annotations", "text_messages", "tolerances_for", "wire_verdict",
]
