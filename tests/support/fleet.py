"""A fleet on one machine for tests and benchmarks: N hosts, each its own ``dockerd`` (own
data root, exec root, pidfile and socket; started through ``deploy.engine.start_dockerd``,
the code path of the default engine) and its own daemon, all sharing one PostgreSQL store.

Engines' data roots live under ``CLOUD_AGENT_FLEET_CACHE`` (default /var/tmp/cloud-agent-fleet)
so the sandbox image (``docker save`` from the default engine, ``docker load`` into each; no
registry) is loaded once per machine, not once per run. One suite at a time uses them (a
file lock). Every container in these engines is this harness's: teardown removes them all.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from deploy.engine import EngineConfig, EngineSetupError, ping, start_dockerd
from tests.daemon_harness import TOKEN, DaemonProcess, free_port, serve_process, test_socket_dir

CACHE = Path(os.environ.get("CLOUD_AGENT_FLEET_CACHE", "/var/tmp/cloud-agent-fleet"))
DEFAULT_ENGINE = f"unix://{EngineConfig.from_env().socket_path}"


def docker_cli(url: str, *args: str, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["docker", "-H", url, *args], capture_output=True, text=True, **kw)


@dataclass
class Engine:
    index: int
    cfg: EngineConfig
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.cfg.socket_path}"

    def start(self) -> None:
        self.proc = start_dockerd(self.cfg)
        if not ping(self.cfg.socket_path):
            raise EngineSetupError("start dockerd", f"engine {self.index} did not answer")

    def kill(self) -> None:
        """The host dies: SIGKILL its dockerd (its API is gone at once) and the containerd it
        runs. A containerd left behind outlives its dockerd for a while; an engine restarted
        in that window found it "still running", could not reach it, and failed to start
        (seen in CI when a test failed right after the kill and teardown restarted at once)."""
        containerd = _pid_in(Path(self.cfg.exec_root or "") / "containerd" / "containerd.pid")
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=30)
        if containerd is not None:
            _kill_and_reap(containerd, b"containerd")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove_all_containers(self) -> None:
        ids = docker_cli(self.url, "ps", "-aq").stdout.split()
        if ids:
            docker_cli(self.url, "rm", "-f", *ids, timeout=120)

    def ensure_image(self, tag: str) -> None:
        """The sandbox image, copied from the default engine when this engine lacks it."""
        if docker_cli(self.url, "image", "inspect", tag).returncode != 0:
            with subprocess.Popen(["docker", "-H", DEFAULT_ENGINE, "save", tag], stdout=subprocess.PIPE) as save:
                load = subprocess.run(["docker", "-H", self.url, "load", "-q"], stdin=save.stdout,
                                      capture_output=True, text=True, timeout=900)
            if load.returncode != 0 or save.returncode != 0:
                raise RuntimeError(f"image copy into engine {self.index} failed: {load.stderr.strip()}")
        stale = [ref for ref in docker_cli(self.url, "images", "--format", "{{.Repository}}:{{.Tag}}",
                                           "cloud-agent-sandbox").stdout.split() if ref != tag]
        if stale:  # earlier runs' images: keep the cache to one image
            docker_cli(self.url, "rmi", "-f", *stale)


@dataclass
class Host:
    name: str
    host_id: str
    engine: Engine
    home: Path
    port: int
    env: dict[str, str]
    daemon: DaemonProcess | None = None
    _stack: ExitStack = field(default_factory=ExitStack)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pause_file(self) -> Path:
        return self.home / "pause-lease"

    def start_daemon(self) -> None:
        argv = [sys.executable, "-m", "tests.support.fleet_serve"]
        self.daemon = self._stack.enter_context(
            serve_process(self.env, self.port, self.home / f"daemon-{self.port}.log", argv=argv))

    def kill(self) -> None:
        """The whole host dies: its daemon and its engine, SIGKILL."""
        if self.daemon is not None:
            self.daemon.kill9()
        self.engine.kill()

    def pause_heartbeat(self, paused: bool = True) -> None:
        if paused:
            self.pause_file.write_text("paused\n")
        else:
            self.pause_file.unlink(missing_ok=True)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers={"authorization": f"Bearer {TOKEN}"},
                                 timeout=httpx.Timeout(600, connect=10))

    def close(self) -> None:
        self._stack.close()


@contextmanager
def _suite_lock() -> Iterator[None]:
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pid_in(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().strip())
    except (OSError, ValueError):
        return None


def _kill_and_reap(pid: int, name: bytes, must_mention: bytes | None = None) -> None:
    """SIGKILL ``pid`` if it still is ``name`` (pids are reused) and wait up to 10 s for it to go."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if cmdline[:1] != [name] or (must_mention is not None and must_mention not in cmdline):
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    for _ in range(100):
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break  # dead, not yet reaped by its new parent
        except OSError:
            break
        time.sleep(0.1)


def _reclaim(data_root: Path) -> None:
    """A dockerd an earlier run of this harness left on this data root (its pidfile says so)."""
    pid = _pid_in(data_root.parent / f"{data_root.name}.pid")
    if pid is not None:
        _kill_and_reap(pid, b"dockerd", must_mention=str(data_root).encode())


@contextmanager
def engines(n: int, image: str) -> Iterator[list[Engine]]:
    """N private engines with the sandbox image, torn down (containers removed) at the end."""
    run_dir = Path(tempfile.mkdtemp(prefix="caf-", dir="/run"))  # short: unix socket paths
    started: list[Engine] = []
    with _suite_lock():
        try:
            for i in range(n):
                data_root = CACHE / f"engine-{i}"
                _reclaim(data_root)
                cfg = EngineConfig(socket_path=str(run_dir / f"e{i}.sock"), data_root=str(data_root),
                                   exec_root=str(run_dir / f"x{i}"), pidfile=str(CACHE / f"engine-{i}.pid"),
                                   ready_timeout_s=120)
                eng = Engine(i, cfg)
                eng.start()
                started.append(eng)
                eng.remove_all_containers()  # leftovers of an interrupted run
                eng.ensure_image(image)
            yield started
        finally:
            for eng in started:
                if eng.proc is not None and eng.proc.poll() is not None:
                    eng.start()  # a killed host's engine comes back only to be cleaned
                eng.remove_all_containers()
                eng.stop()
                # dockerd leaves its default network namespace bind-mounted in the exec root
                netns = Path(eng.cfg.exec_root or "") / "netns" / "default"
                if os.path.ismount(netns):
                    subprocess.run(["umount", "-l", str(netns)], capture_output=True)
            shutil.rmtree(run_dir, ignore_errors=True)


@contextmanager
def fleet_hosts(engines_: list[Engine], *, store_url: str, gateway_url: str, image: str, root: Path,
                lease_ttl_s: float = 3.0, capacities: list[int] | None = None,
                extra_env: dict[str, str] | None = None) -> Iterator[list[Host]]:
    """One daemon per engine, all on the shared store; stopped at the end."""
    hosts: list[Host] = []
    try:
        for i, eng in enumerate(engines_):
            home = root / f"host{i}"
            home.mkdir(parents=True, exist_ok=True)
            (home / "token").write_text(TOKEN + "\n")
            port = free_port()
            host_id = f"fleet-{os.getpid()}-{i}"
            env = dict(os.environ, CLOUD_AGENT_HOME=str(home), CLOUD_AGENT_GATEWAY_URL=gateway_url,
                       CLOUD_AGENT_IMAGE=image, CLOUD_AGENT_SERVICE_TOKEN_FILE=str(home / "token"),
                       CLOUD_AGENT_SOCKET_DIR=test_socket_dir(home), CLOUD_AGENT_HOST_ID=host_id,
                       CLOUD_AGENT_LISTEN_PORT=str(port), CLOUD_AGENT_DOCKER_URL=eng.url,
                       CLOUD_AGENT_STORE_URL=store_url, CLOUD_AGENT_LEASE_TTL_S=str(lease_ttl_s),
                       CLOUD_AGENT_HOST_CAPACITY=str((capacities or [100] * len(engines_))[i]),
                       CA_TEST_PAUSE_FILE=str(home / "pause-lease"), **(extra_env or {}))
            host = Host(name=f"host{i}", host_id=host_id, engine=eng, home=home, port=port, env=env)
            hosts.append(host)
            host.start_daemon()
        yield hosts
    finally:
        for h in hosts:
            h.close()


def ndjson(body: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in body.splitlines() if line.strip()]
