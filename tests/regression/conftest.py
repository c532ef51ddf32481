"""Shared fixtures of the full-stack regression suites (SPEC 9.1 / 9.2, tests/regression/).

Everything here runs the REAL stack: the daemon in-process (``tests.daemon_harness``) ->
runner -> retained sandbox -> pinned CLI -> the loopback model fixture.

* ``anyio_backend`` is module-scoped here so that module-scoped async fixtures work
  (one daemon per test module instead of one per test: daemon start-up and the reverse
  probe cost seconds each).
* ``fx``: one loopback fixture per test module. Tests share it, so every rule a test adds
  must ``match=`` text unique to that test (or use ``times=``), and every assertion on
  recorded requests must look only at requests after a ``high_water`` mark.
* ``daemon``: one daemon (default settings, no test hooks) per test module, on ``fx``.
* ``regression_daemon(...)``: an async context manager for a daemon with test hooks or
  setting overrides (e.g. ``TestHooks(disable_retire_after=True)``).

Every daemon started here gets its own home and host id; at teardown the containers it
created (label ``org.cloud-agent.host-id``) are removed, so the suite leaves no sandboxes
behind.

Tests in this directory mark themselves: ``pytestmark = [pytest.mark.regression,
pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]``.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from deploy.loopback import LoopbackFixture
from drivers.transport import Transport
from runner import event_loop
from runner.config import Settings
from runner.turn import TestHooks
from sandbox_manager.identity import LABEL_HOST
from tests.daemon_harness import RunningDaemon, daemon_settings, running_daemon
from tests.regression.supervisor_text import WireRecorder
from tests.support.workers import in_worker, leave_report


@pytest.fixture(scope="module")
def anyio_backend() -> tuple[str, dict]:
    return event_loop.BACKEND, event_loop.BACKEND_OPTIONS  # the product's loop


@pytest.fixture(scope="module")
def fx() -> Iterator[LoopbackFixture]:
    with LoopbackFixture.start() as fixture:
        yield fixture


def remove_host_containers(docker_client: Any, host_id: str) -> None:
    """Remove every container and state volume a daemon with ``host_id`` created (best effort)."""
    # low-level list: one call, no per-container inspect that a concurrent removal could trip
    for row in docker_client.api.containers(all=True, filters={"label": f"{LABEL_HOST}={host_id}"}):
        try:
            docker_client.api.remove_container(row["Id"], force=True)
        except Exception:  # noqa: BLE001 - already gone, or the engine is busy: nothing to keep
            pass
    for vol in (docker_client.api.volumes(filters={"label": f"{LABEL_HOST}={host_id}"}) or {}).get("Volumes") or []:
        try:
            docker_client.api.remove_volume(vol["Name"])
        except Exception:  # noqa: BLE001
            pass


@asynccontextmanager
async def regression_daemon(fx: LoopbackFixture, image: str, docker_client: Any, base: Path, *,
                            hooks: TestHooks | None = None, **overrides: Any) -> AsyncIterator[RunningDaemon]:
    """A real daemon on ``fx`` with its own home under ``base``; its containers removed after.

    Every CLI's transport is recorded (``d.wire``, a :class:`WireRecorder` innermost, under any
    ``hooks.wrap_transport``) for the "supervisor adds nothing" check.
    """
    home = base / f"home-{uuid.uuid4().hex[:10]}"
    settings = daemon_settings(home, fx.base_url, image, **overrides)
    host_id = settings.resolved_host_id()
    try:
        async with recorded_daemon(settings, hooks=hooks) as d:
            yield d
    finally:
        remove_host_containers(docker_client, host_id)


@asynccontextmanager
async def recorded_daemon(settings: Settings, *, hooks: TestHooks | None = None) -> AsyncIterator[RunningDaemon]:
    """``running_daemon`` with every CLI's transport recorded as ``d.wire``."""
    wire = WireRecorder()
    hooks = hooks or TestHooks()
    outer = hooks.wrap_transport

    def wrap(transport: Transport, runtime: str) -> Transport:
        recorded = wire.wrap(transport, runtime)
        return outer(recorded, runtime) if outer is not None else recorded

    async with running_daemon(settings, hooks=replace(hooks, wrap_transport=wrap)) as d:
        d.wire = wire
        yield d


@pytest.fixture(scope="module")
async def daemon(fx: LoopbackFixture, sandbox_image: str, docker_client: Any,
                 tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RunningDaemon]:
    async with regression_daemon(fx, sandbox_image, docker_client, tmp_path_factory.mktemp("regression")) as d:
        yield d


def print_report(request: pytest.FixtureRequest, lines: list[str]) -> None:
    """Write a module's report to the terminal at its end, past output capture (nothing when
    the module produced no lines). On an xdist worker it is left for the controller to print
    (tests/support/workers.py)."""
    if in_worker(request.config):
        if lines:
            leave_report(request.node.nodeid, lines)
        return
    tr = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if tr is None or not lines:
        return
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        for line in ["", *lines]:
            tr.write_line(line)
