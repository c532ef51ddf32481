"""Shared test fixtures.

Tiers (pytest markers): unmarked tests are the fast unit tier; ``docker`` tests need a
running engine and the pinned image; ``cli`` tests drive a real pinned CLI; ``browser``
tests drive Debian's headless Chromium (tests/browser). CI runs all of them. ``pytest -m "not docker and not cli"`` runs the unit tier alone.
"""

from __future__ import annotations

import pytest


# scripts/test runs two xdist workers: the engine tiers on one, in order (tests/support/workers.py)
def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest hook
    from tests.support.workers import in_worker, note_engine_tests

    if in_worker(config):
        note_engine_tests(items)


def pytest_xdist_make_scheduler(config, log):  # noqa: ANN001, ANN201 - xdist hook
    from tests.support.workers import engine_apart

    return engine_apart(config, log)


def pytest_configure(config) -> None:  # noqa: ANN001 - pytest hook
    from tests.support.workers import open_shared

    open_shared(config)


@pytest.fixture
def sqlite_store(tmp_path):
    """An embedded store in the test's own directory, closed after it."""
    from state.store import Store

    s = Store(tmp_path / "s.db")
    yield s
    s.close()


@pytest.fixture
def anyio_backend() -> tuple[str, dict]:
    from runner import event_loop

    return event_loop.BACKEND, event_loop.BACKEND_OPTIONS  # the loop the daemon and the proxy service run on


@pytest.fixture(scope="session", autouse=True)
def _end_stray_proxy_services(tmp_path_factory):
    """No model proxy service of this session outlives it (tests/support/proxy_services.py)."""
    yield
    from tests.daemon_harness import TEST_HOMES
    from tests.support.proxy_services import end_strays

    pids = end_strays(set(TEST_HOMES), tmp_path_factory.getbasetemp())
    if pids:
        print(f"\nended {len(pids)} model proxy service(s) left by this session: {pids}")


@pytest.fixture(scope="session")
def docker_client():
    import docker
    import docker.errors

    from deploy.engine import EngineConfig, ping
    from runner.probe import PROBE_LABEL

    cfg = EngineConfig.from_env()
    if not ping(cfg.socket_path):
        pytest.fail(f"no Docker engine answers on {cfg.socket_path}: run `python -m deploy.engine` first "
                    "(the README's test command does)")
    client = docker.DockerClient(base_url=f"unix://{cfg.socket_path}")
    before = {c["Id"] for c in client.api.containers(all=True, filters={"label": PROBE_LABEL})}
    yield client
    # A daemon killed (kill -9) while its reverse probe runs leaves the probe's container; the
    # next daemon of that host sweeps it, but a test's host never comes back.
    for c in client.api.containers(all=True, filters={"label": PROBE_LABEL}):
        if c["Id"] not in before:
            try:
                client.api.remove_container(c["Id"], force=True)
            except docker.errors.APIError:
                pass
    client.close()


@pytest.fixture(scope="session")
def sandbox_image(docker_client) -> str:
    """Tag of the pinned sandbox image (built if missing: the README's test command builds it first)."""
    from images.build import ensure_image

    return ensure_image()


@pytest.fixture(scope="module", autouse=True)
def _remove_this_modules_sandboxes():
    """Retained sandboxes (containers and state volumes) outlive their daemon by design; tests
    must not leave theirs behind.

    Module scope, autouse: torn down after the module's own (module-scoped) daemons, so a
    daemon restart inside a module still finds its sandboxes. Only sandboxes of daemons this
    test process started (their host ids) are removed: the engine may be shared.
    """
    from datetime import UTC, datetime

    started = datetime.now(UTC)
    yield
    from deploy.engine import EngineConfig, ping

    cfg = EngineConfig.from_env()
    if not ping(cfg.socket_path):
        return
    import docker

    from tests.daemon_harness import TEST_HOST_IDS

    client = docker.DockerClient(base_url=f"unix://{cfg.socket_path}")
    try:
        # low-level list: one call, no per-container inspect that a concurrent removal could trip
        for row in client.api.containers(all=True, filters={"label": "org.cloud-agent.sandbox=1"}):
            created = datetime.fromtimestamp(row["Created"], UTC)
            if created >= started.replace(microsecond=0) and row["Labels"].get("org.cloud-agent.host-id") in TEST_HOST_IDS:
                try:
                    client.api.remove_container(row["Id"], force=True)
                except docker.errors.APIError:
                    pass
        # then their state volumes (a volume in use by a container cannot go before it)
        for vol in (client.api.volumes(filters={"label": "org.cloud-agent.sandbox=1"}) or {}).get("Volumes") or []:
            labels = vol.get("Labels") or {}
            created = datetime.fromisoformat(vol["CreatedAt"].replace("Z", "+00:00"))
            if created >= started.replace(microsecond=0) and labels.get("org.cloud-agent.host-id") in TEST_HOST_IDS:
                try:
                    client.api.remove_volume(vol["Name"])
                except docker.errors.APIError:
                    pass
    finally:
        client.close()


# -- suite durations (CI prints how long each suite took) ------------------------------------

_SUITE_SECONDS: dict[str, float] = {}
_SUITE_COUNTS: dict[str, int] = {}


def _suite_of(nodeid: str) -> str:
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) >= 3 and parts[1] == "regression":
        return "regression/" + parts[2].removesuffix(".py")  # history, identity, lost: one suite each
    return parts[1] if len(parts) >= 3 else parts[0]


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 - pytest hook
    suite = _suite_of(report.nodeid)
    _SUITE_SECONDS[suite] = _SUITE_SECONDS.get(suite, 0.0) + report.duration
    if report.when == "call":
        _SUITE_COUNTS[suite] = _SUITE_COUNTS.get(suite, 0) + 1


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest hook
    from tests.support.workers import print_reports

    print_reports(terminalreporter)
    if not _SUITE_SECONDS:
        return
    terminalreporter.section("suite durations")
    for suite, seconds in sorted(_SUITE_SECONDS.items()):
        terminalreporter.write_line(f"{suite:<24} {seconds:8.1f} s  ({_SUITE_COUNTS.get(suite, 0)} tests)")


EXIT_WATCHDOG_S = 300


def pytest_unconfigure(config) -> None:  # noqa: ANN001 - pytest hook
    """A thread left waiting at interpreter exit (threading._shutdown joins every non-daemon
    thread) hangs the run after its summary, and CI only sees a timeout. If the process has not
    exited EXIT_WATCHDOG_S after the session, print every thread's stack and exit non-zero.

    Not on an xdist worker: its session ends when it has no more work, and it then waits, by
    design, until the controller ends the whole run (the controller's own watchdog covers it)."""
    import faulthandler
    import sys

    from tests.support.workers import in_worker

    if in_worker(config):
        return

    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True, file=sys.stderr)
