"""Run the real daemon for tests: in-process (uvicorn on an ephemeral port in a task) or as
a subprocess (`cloud-agent serve`, for kill -9 and restart tests)."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx
import uvicorn

from runner.config import Settings, load_settings
from runner.model_path import ModelPath, service_config
from runner.proxy_client import service_status, stop_service
from runner.proxy_protocol import ServicePaths
from runner.proxy_service import run_service
from runner.serve import Daemon, build_daemon
from runner.turn import TestHooks

TOKEN = "test-service-token-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Host ids of the daemons this test process started: the module teardown in conftest.py
# removes their sandboxes (and never another process's, on a shared engine).
TEST_HOST_IDS: set[str] = set()
# Homes of the daemons this test process started: the session's end stops any model proxy
# service of theirs still running (tests/support/proxy_services.py).
TEST_HOMES: set[Path] = set()


def stop_proxy_service(home: Path) -> None:
    """A daemon's model proxy service outlives it by design (SPEC 14); a test's must not.
    Blocking (a thread of its own: the caller may be inside an event loop)."""
    with ThreadPoolExecutor(1) as pool:
        pool.submit(anyio.run, stop_service, ServicePaths(home)).result(timeout=120)


def test_host_id(home: Path) -> str:
    """Stable per state dir (a restarted daemon on the same home is the same host)."""
    return "test-" + hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]


def test_socket_dir(home: Path) -> str:
    """A short socket root per state dir (a tmp_path is too long for a unix socket address);
    stable, so a restarted daemon on the same home finds its sockets' mounted directories."""
    return "/tmp/ca-sock-" + hashlib.sha256(str(home.resolve()).encode()).hexdigest()[:12]


def daemon_settings(home: Path, gateway_url: str, image: str, **overrides: Any) -> Settings:
    token_file = home / "token"
    home.mkdir(parents=True, exist_ok=True)
    token_file.write_text(TOKEN + "\n")
    env = {"CLOUD_AGENT_HOME": str(home), "CLOUD_AGENT_GATEWAY_URL": gateway_url, "CLOUD_AGENT_IMAGE": image,
           "CLOUD_AGENT_SERVICE_TOKEN_FILE": str(token_file), "CLOUD_AGENT_SOCKET_DIR": test_socket_dir(home),
           "CLOUD_AGENT_HOST_ID": test_host_id(home)}
    settings = load_settings(env, **overrides)
    TEST_HOST_IDS.add(settings.resolved_host_id())
    TEST_HOMES.add(settings.home)
    return settings


@dataclass
class RunningDaemon:
    daemon: Daemon
    url: str
    client: httpx.AsyncClient
    wire: Any = None  # the regression suites' WireRecorder (tests/regression/supervisor_text.py)

    async def run(self, job: dict[str, Any]) -> tuple[dict[str, Any] | None, list[dict[str, Any]], httpx.Response]:
        """POST a job; return (receipt, events, response)."""
        events: list[dict[str, Any]] = []
        async with self.client.stream("POST", "/v1/jobs", json=job) as resp:
            async for line in resp.aiter_lines():
                if line.strip():
                    events.append(json.loads(line))
        receipt = next((e["receipt"] for e in events if e.get("type") == "receipt"), None)
        return receipt, events, resp


@asynccontextmanager
async def in_process_service(model_path: ModelPath) -> AsyncIterator[None]:
    """The daemon's model proxy service, served from this process's event loop: the daemon
    attaches to it over its control socket exactly as to the detached process (same build,
    same configuration) but no process is started per test (each costs ~1.2 s on this
    machine, ~250 daemons a suite run). The process itself — detaching, outliving the daemon —
    is what the subprocess daemons (``daemon_process``) and tests/unit/test_proxy_service.py
    exercise."""
    config = service_config(model_path.settings, model_path.config)
    config.paths.prepare()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run_service, config)
        with anyio.fail_after(60):
            while await service_status(config.paths) is None:
                await anyio.sleep(0.01)
        try:
            yield
        finally:
            with anyio.CancelScope(shield=True):
                await stop_service(config.paths)


@asynccontextmanager
async def running_daemon(settings: Settings, *, hooks: TestHooks | None = None,
                         proxy_process: bool = False) -> AsyncIterator[RunningDaemon]:
    """``proxy_process``: the model proxy service as the detached process production runs
    (by default, in this process: :func:`in_process_service`)."""
    port = free_port()
    settings = settings.model_copy(update={"listen_port": port})
    daemon = build_daemon(settings, hooks=hooks)
    config = uvicorn.Config(daemon.app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                            lifespan="on", http="httptools")  # as runner.serve: the same HTTP parser
    server = uvicorn.Server(config)
    TEST_HOMES.add(settings.home)
    model_path = daemon.supervisor.model_path
    local = nullcontext() if proxy_process or model_path.in_daemon else in_process_service(model_path)
    try:
        async with local, anyio.create_task_group() as tg:
            tg.start_soon(server.serve)
            with anyio.fail_after(60):
                while not server.started:
                    await anyio.sleep(0.05)
            url = f"http://127.0.0.1:{port}"
            async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {TOKEN}"},
                                         timeout=httpx.Timeout(600, connect=10)) as client:
                try:
                    yield RunningDaemon(daemon=daemon, url=url, client=client)
                finally:
                    server.should_exit = True
    finally:
        with anyio.CancelScope(shield=True):
            await stop_service(ServicePaths(settings.home))  # the daemon is gone: nothing needs it


@dataclass
class DaemonProcess:
    """``python -m runner.cli serve`` as a subprocess; its stdout and stderr go to ``log_path``."""

    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@contextmanager
def serve_process(env: dict[str, str], port: int, log_path: Path, *,
                  cwd: Path | None = None, argv: list[str] | None = None) -> Iterator[DaemonProcess]:
    """Run the daemon with exactly ``env`` on ``port``; yield once /healthz answers (60 s at
    most), terminate it at the end and stop its model proxy service — unless the test ended the
    daemon itself (``kill -9``, SIGTERM): a restart test's next daemon attaches to that service."""
    if env.get("CLOUD_AGENT_HOST_ID"):
        TEST_HOST_IDS.add(env["CLOUD_AGENT_HOST_ID"])
    home = Path(env["CLOUD_AGENT_HOME"]) if env.get("CLOUD_AGENT_HOME") else None
    if home is not None:
        TEST_HOMES.add(home)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(argv or [sys.executable, "-m", "runner.cli", "serve"], env=env, stdout=log, stderr=log,
                                cwd=cwd, start_new_session=True)
    dp = DaemonProcess(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(f"{dp.url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not start: {dp.log()[-2000:]}")
            time.sleep(0.1)
        yield dp
    finally:
        ended_by_the_test = proc.poll() is not None
        dp.terminate()
        if home is not None and not ended_by_the_test:
            stop_proxy_service(home)


@contextmanager
def daemon_process(home: Path, gateway_url: str, image: str, *, port: int | None = None,
                   env: dict[str, str] | None = None) -> Iterator[DaemonProcess]:
    """``env``: more settings (e.g. ``CLOUD_AGENT_TURN_TIMEOUT_S``) on top of the test defaults."""
    port = port or free_port()
    home.mkdir(parents=True, exist_ok=True)
    (home / "token").write_text(TOKEN + "\n")
    env = dict(os.environ, CLOUD_AGENT_HOME=str(home), CLOUD_AGENT_GATEWAY_URL=gateway_url, CLOUD_AGENT_IMAGE=image,
               CLOUD_AGENT_SERVICE_TOKEN_FILE=str(home / "token"), CLOUD_AGENT_SOCKET_DIR=test_socket_dir(home),
               CLOUD_AGENT_HOST_ID=test_host_id(home), CLOUD_AGENT_LISTEN_PORT=str(port)) | (env or {})
    with serve_process(env, port, home / f"daemon-{port}.log") as dp:
        yield dp
