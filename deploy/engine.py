"""Make sure a Docker engine answers: install docker.io and start dockerd when none does.

Used by both README commands (``python -m deploy.engine``). Idempotent: when an engine
answers ``/_ping`` on the configured socket nothing is installed or started, so there is
never a second daemon. There is no systemd on the target machines, so dockerd is
started here, detached, with its log under the data root's parent.

Environment:
  CLOUD_AGENT_DOCKER_SOCKET     engine socket (default /var/run/docker.sock)
  CLOUD_AGENT_DOCKER_DATA_ROOT  --data-root for a dockerd started here (default /var/lib/docker)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("engine")

DEFAULT_SOCKET = "/var/run/docker.sock"
DEFAULT_DATA_ROOT = "/var/lib/docker"


class EngineSetupError(RuntimeError):
    """A named step of the engine set-up failed."""

    def __init__(self, step: str, detail: str) -> None:
        super().__init__(f"engine set-up failed at step '{step}': {detail}")
        self.step = step


@dataclass(frozen=True)
class EngineConfig:
    socket_path: str = DEFAULT_SOCKET
    data_root: str = DEFAULT_DATA_ROOT
    ready_timeout_s: float = 60.0
    # A second engine on the same machine (the fleet tests' hosts) needs its own exec root
    # (its containerd and runtime state) and pidfile; None = dockerd's defaults.
    exec_root: str | None = None
    pidfile: str | None = None

    @classmethod
    def from_env(cls) -> "EngineConfig":
        return cls(
            socket_path=os.environ.get("CLOUD_AGENT_DOCKER_SOCKET", DEFAULT_SOCKET),
            data_root=os.environ.get("CLOUD_AGENT_DOCKER_DATA_ROOT", DEFAULT_DATA_ROOT),
        )


def ping(socket_path: str, timeout: float = 2.0) -> bool:
    """True when an engine answers ``GET /_ping`` with ``OK`` on the unix socket."""
    if not os.path.exists(socket_path):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            s.connect(socket_path)
            s.sendall(b"GET /_ping HTTP/1.0\r\nHost: docker\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
    except OSError:
        return False
    return data.startswith(b"HTTP/1.") and b" 200 " in data.split(b"\r\n", 1)[0] and data.endswith(b"OK")


def _run(step: str, argv: list[str]) -> None:
    log.info("engine.step", step=step, argv=" ".join(argv))
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise EngineSetupError(step, f"exit {proc.returncode}: " + " | ".join(tail))


def install_engine() -> None:
    if shutil.which("dockerd"):
        return
    if os.geteuid() != 0:
        raise EngineSetupError("install docker.io", "not root: cannot apt-get install docker.io")
    env_note = {"DEBIAN_FRONTEND": "noninteractive"}
    os.environ.update(env_note)
    _run("apt-get update", ["apt-get", "update", "-q"])
    _run("apt-get install docker.io", ["apt-get", "install", "-y", "-q", "--no-install-recommends", "docker.io"])
    if not shutil.which("dockerd"):
        raise EngineSetupError("install docker.io", "dockerd is still not on PATH after installing docker.io")


def start_dockerd(cfg: EngineConfig) -> subprocess.Popen[bytes]:
    if os.geteuid() != 0:
        raise EngineSetupError("start dockerd", "not root: dockerd must run as root here")
    data_root = Path(cfg.data_root)
    data_root.mkdir(parents=True, exist_ok=True)
    log_path = data_root.parent / f"{data_root.name}-dockerd.log"
    argv = [
        "dockerd",
        "--data-root", str(data_root),
        "-H", f"unix://{cfg.socket_path}",
        # Keep Docker off private address ranges and the host firewall;
        # `host` and `none` networking still work.
        "--bridge", "none", "--iptables=false", "--ip-masq=false",
    ]
    if cfg.exec_root:
        argv += ["--exec-root", cfg.exec_root]
    if cfg.pidfile:
        argv += ["--pidfile", cfg.pidfile]
    log.info("engine.step", step="start dockerd", argv=" ".join(argv), log=str(log_path))
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, close_fds=True)
    deadline = time.monotonic() + cfg.ready_timeout_s
    while time.monotonic() < deadline:
        if ping(cfg.socket_path):
            return proc
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    tail = log_path.read_text(errors="replace").strip().splitlines()[-5:] if log_path.exists() else []
    raise EngineSetupError("wait for /_ping", f"no answer within {cfg.ready_timeout_s:.0f}s; dockerd log: " + " | ".join(tail))


def ensure_engine(cfg: EngineConfig | None = None) -> str:
    """Return the engine socket path once an engine answers, starting one when needed."""
    cfg = cfg or EngineConfig.from_env()
    if ping(cfg.socket_path):
        log.info("engine.ready", socket=cfg.socket_path, started=False)
        return cfg.socket_path
    install_engine()
    if ping(cfg.socket_path):  # the package's own scripts may have started one
        return cfg.socket_path
    start_dockerd(cfg)
    log.info("engine.ready", socket=cfg.socket_path, started=True, data_root=cfg.data_root)
    return cfg.socket_path


def main() -> int:
    from telemetry.logs import configure_logging

    configure_logging()
    try:
        ensure_engine()
    except EngineSetupError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
