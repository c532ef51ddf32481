"""Helpers for the attestation, reliability and security tests against real daemons."""

from __future__ import annotations

from dataclasses import dataclass

import os
import subprocess
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

from tests.daemon_harness import DaemonProcess, free_port, serve_process, test_socket_dir

REPO = Path(__file__).resolve().parents[2]


def git_head() -> str:
    return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                          check=True).stdout.strip()


def git_dirty() -> bool:
    out = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=normal"],
                         capture_output=True, text=True, check=True).stdout
    return bool(out.strip())


@contextmanager
def relabelled_image(base: str, **labels: str) -> Iterator[str]:
    """``base`` + LABEL lines, built with ``docker build`` (no registry, no network); removed after."""
    tag = f"cloud-agent-sandbox-test:{uuid.uuid4().hex[:12]}"
    dockerfile = f"FROM {base}\n" + "".join(f'LABEL "{k}"="{v}"\n' for k, v in labels.items())
    subprocess.run(["docker", "build", "--network", "none", "-q", "-t", tag, "-"], input=dockerfile.encode(),
                   check=True, capture_output=True, env=dict(os.environ, DOCKER_BUILDKIT="0"))
    try:
        yield tag
    finally:
        subprocess.run(["docker", "rmi", "-f", tag], capture_output=True)


async def wait_ready(client: httpx.AsyncClient, *, want: int = 200, timeout_s: float = 60) -> dict[str, Any]:
    """Poll /readyz until it answers ``want``; return its body."""
    body: dict[str, Any] = {}
    with anyio.fail_after(timeout_s):
        while True:
            resp = await client.get("/readyz")
            body = resp.json()
            if resp.status_code == want and "reverse_probe_pending" not in body.get("reasons", []):
                return body
            await anyio.sleep(0.1)


@contextmanager
def spawn_daemon(home: Path, env: dict[str, str]) -> Iterator[DaemonProcess]:
    """`python -m runner.cli serve` with exactly ``env`` on top of this process's environment
    (minus any CLOUD_AGENT_* the test did not set); its stdout and stderr go to one log file."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith("CLOUD_AGENT_")}
    full = base | {"CLOUD_AGENT_HOME": str(home), "CLOUD_AGENT_LISTEN_PORT": str(port),
                   "CLOUD_AGENT_SOCKET_DIR": test_socket_dir(home)} | env
    with serve_process(full, port, home / f"daemon-{port}.log", cwd=REPO) as spawned:
        yield spawned


@dataclass(frozen=True)
class ListedContainer:
    id: str
    name: str


def probe_containers(docker_client: Any, host_id: str) -> list[ListedContainer]:
    """One list call (no per-container inspect): a probe container may be removed between
    the engine's listing and a later inspect, which the high-level SDK list would trip on."""
    rows = docker_client.api.containers(all=True, filters={"label": f"org.cloud-agent.probe={host_id}"})
    return [ListedContainer(id=r["Id"], name=r["Names"][0].lstrip("/")) for r in rows]
