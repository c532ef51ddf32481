"""`cloud-agent serve`: the host daemon (HTTP API + supervisor), one process."""

from __future__ import annotations

import ipaddress
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import structlog
import uvicorn
from starlette.applications import Starlette

from runner import event_loop, heap
from runner.breaker import CircuitBreaker
from runner.config import Settings
from runner.control_plane import HeartbeatPublisher
from runner.daemon import Api, create_app
from runner.fleet import Fleet
from runner.forwarding import FleetGate
from runner.supervisor import Supervisor, build_supervisor
from runner.turn import TestHooks
from telemetry.gc_pauses import GcPauses

log = structlog.get_logger("serve")


class StartupRefused(RuntimeError):
    pass


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class Daemon:
    """The daemon's parts, for tests that run it in-process."""

    settings: Settings
    gateway_url: str
    supervisor: Supervisor
    app: Starlette
    attestor: Any = None


def control_plane(settings: Settings, supervisor: Supervisor) -> HeartbeatPublisher | None:
    """The optional control-plane heartbeat, behind the breaker (None when not configured)."""
    if not settings.control_plane_url:
        return None
    breaker = CircuitBreaker(failure_threshold=settings.breaker_failures, reset_timeout_s=settings.breaker_reset_s)
    hb = supervisor.heartbeat

    def body() -> dict[str, Any]:
        return {"host_id": supervisor.manager.config.host_id, "owner": supervisor.owner, "beats": hb.beats,
                "last_beat": hb.last_beat.isoformat() if hb.last_beat else None, "interval_s": hb.interval_s}

    return HeartbeatPublisher(settings.control_plane_url, body=body, breaker=breaker,
                              interval_s=settings.heartbeat_interval_s, timeout_s=settings.control_plane_timeout_s)


def fleet_parts(settings: Settings, supervisor: Supervisor, token: Any,
                hooks: TestHooks | None) -> tuple[Fleet | None, FleetGate | None]:
    """A shared store makes this daemon a fleet host: its lease, placement and forwarding."""
    if not settings.fleet:
        return None, None
    fleet = Fleet(supervisor.store, host_id=supervisor.manager.config.host_id, api_url=settings.resolved_api_url(),
                  capacity=settings.host_capacity, ttl_s=settings.lease_ttl_s,
                  lease_paused=hooks.lease_paused if hooks else None)
    gate = FleetGate(fleet, token, owner=supervisor.owner, timeout_s=settings.forward_timeout_s)
    return fleet, gate


def check_token(settings: Settings) -> str | None:
    """The service token, or None in loopback-only development mode; refuses anything else."""
    token = settings.service_token()
    if token is None:
        if not settings.dev_mode:
            raise StartupRefused("no service token: set CLOUD_AGENT_SERVICE_TOKEN_FILE "
                                 "(or CLOUD_AGENT_DEV_MODE=1 for loopback-only development)")
        if not is_loopback(settings.listen_host):
            raise StartupRefused(f"development mode without a token only listens on loopback, not "
                                 f"{settings.listen_host}")
    return token


def build_daemon(settings: Settings, *, hooks: TestHooks | None = None,
                 on_ready: Callable[[], None] | None = None) -> Daemon:
    """``on_ready``: called once the daemon is ready, before it serves (``serve``: runner.heap)."""
    token = check_token(settings)
    if token is None:
        log.warning("daemon.dev_mode", detail="no service token: every route is open to local callers")
    gateway_url = settings.gateway_url
    if gateway_url is None:
        # `cloud-agent serve` fills in its default (the loopback fixture, runner.loopback_child)
        raise StartupRefused("no gateway: set CLOUD_AGENT_GATEWAY_URL")
    supervisor = build_supervisor(settings, gateway_url, hooks=hooks)

    from runner.attestation import Attestor

    attestor = Attestor(supervisor, probe_interval_s=settings.probe_interval_s,
                        probe_timeout_s=settings.probe_timeout_s, publisher=control_plane(settings, supervisor))

    fleet, gate = fleet_parts(settings, supervisor, token, hooks)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # a fleet host joins (and binds its lease to the store) before recovering its jobs
        async with AsyncExitStack() as stack:
            if fleet is not None:
                await stack.enter_async_context(fleet.running())
            if gate is not None:
                stack.push_async_callback(gate.aclose)
            await stack.enter_async_context(supervisor.running())
            await stack.enter_async_context(attestor.running())
            if on_ready is not None:
                on_ready()
            log.info("daemon.ready", listen=f"{settings.listen_host}:{settings.listen_port}", gateway=gateway_url,
                     owner=supervisor.owner)
            yield

    async def readiness() -> tuple[list[str], dict[str, str]]:
        reasons, detail = await attestor.readiness()
        if fleet is not None and not fleet.lease_valid():
            reasons, detail = [*reasons, "host_fenced"], {**detail, "host_fenced": "the fleet lease expired"}
        return reasons, detail

    api = Api(supervisor, token, max_message_bytes=settings.max_message_bytes, max_body_bytes=settings.max_body_bytes,
              attestation=attestor.document, readiness=readiness, gate=gate)
    return Daemon(settings=settings, gateway_url=gateway_url, supervisor=supervisor,
                  app=create_app(api, lifespan=lifespan), attestor=attestor)


def serve(settings: Settings) -> None:
    def ready() -> None:
        log.info("daemon.heap_frozen", objects=heap.freeze_startup())
        GcPauses(daemon.supervisor.metrics.registry).install()  # the collections from now on

    daemon = build_daemon(settings, on_ready=ready)
    # httptools (llhttp, in C) rather than h11: a turn's request and its NDJSON event lines cost
    # less on the event loop the turns share (issue 16)
    config = uvicorn.Config(daemon.app, host=settings.listen_host, port=settings.listen_port, log_config=None,
                            access_log=False, lifespan="on", timeout_graceful_shutdown=10, http="httptools",
                            loop=event_loop.UVICORN_LOOP)
    uvicorn.Server(config).run()
