"""Optional control-plane heartbeat: POST the daemon's beat to CLOUD_AGENT_CONTROL_PLANE_URL.

The control plane is an optional outbound dependency. Every publication runs in its own
task with a hard timeout and behind the keyed circuit breaker, so a dead control plane
(refusing, or accepting and never answering) costs at most ``failure_threshold`` timeouts
before every further beat fails fast; it never delays the local heartbeat, never blocks the
event loop and never holds anything a turn needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import anyio
import httpx
import structlog

from runner.breaker import BreakerOpen, CircuitBreaker

log = structlog.get_logger("control_plane")


def redact_url(url: str) -> str:
    """The URL without userinfo, query or fragment (they may carry credentials)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


class HeartbeatPublisher:
    def __init__(self, url: str, *, body: Callable[[], dict[str, Any]], breaker: CircuitBreaker,
                 interval_s: float, timeout_s: float, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.url = url
        self.body = body
        self.breaker = breaker
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.key = f"control-plane {redact_url(url)}"
        self._transport = transport
        self.sent = 0
        self.failed = 0
        self.fast_failed = 0
        self._client: httpx.AsyncClient | None = None

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.timeout_s), transport=self._transport,
                                             follow_redirects=False)
        return self._client

    async def publish_once(self) -> str:
        """One beat: ``sent`` | ``failed`` | ``fast_failed`` (the breaker refused the call)."""
        try:
            async with self.breaker.guard(self.key):
                with anyio.fail_after(self.timeout_s):
                    resp = await self._http().post(self.url, json=self.body())
                if resp.status_code >= 300:
                    raise RuntimeError(f"control plane answered HTTP {resp.status_code}")
        except BreakerOpen:
            self.fast_failed += 1
            return "fast_failed"
        except Exception as exc:  # noqa: BLE001 - an optional dependency never takes anything down
            self.failed += 1
            log.debug("control_plane.beat_failed", url=redact_url(self.url), error=type(exc).__name__)
            return "failed"
        self.sent += 1
        return "sent"

    async def run(self) -> None:
        """Publish every ``interval_s``; each beat in its own task, so a hanging one delays none."""
        try:
            async with anyio.create_task_group() as tg:
                while True:
                    tg.start_soon(self.publish_once)
                    await anyio.sleep(self.interval_s)
        finally:
            if self._client is not None:
                with anyio.CancelScope(shield=True):
                    await self._client.aclose()

    def status(self) -> dict[str, Any]:
        circuit = self.breaker.snapshot().get(self.key, {"state": "closed"})
        return {"url": redact_url(self.url), "interval_s": self.interval_s, "timeout_s": self.timeout_s,
                "sent": self.sent, "failed": self.failed, "fast_failed": self.fast_failed, "circuit": circuit}
