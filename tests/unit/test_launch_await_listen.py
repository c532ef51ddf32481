"""ca-launch's ``--await-listen HOST:PORT SECONDS`` (issue 16): the CLI starts only once its
model endpoint listens, read from /proc/net/tcp without a connection; after the seconds, one
``launch_error`` line (``model_gate_not_listening``) and exit 3, the CLI never started. The
driver's handshake and the runner say ``model_gate_not_ready``, as when the daemon waited
for the gate's line itself."""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import importlib.util
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from drivers.base import LaunchError
from drivers.launch import LaunchSpec
from drivers.models import HandshakeReason
from drivers.session import NativeSession

LAUNCHER = Path(__file__).resolve().parents[2] / "images" / "sandbox" / "helpers" / "ca-launch"


def launch(tmp_path: Path, addr: str, seconds: str = "5") -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["python3", str(LAUNCHER), "--pidfile", str(tmp_path / "cli.pid"), "--await-listen",
                           addr, seconds, "--", "echo", "started"], capture_output=True, check=False, timeout=30)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_proc_net_tcp_addresses() -> None:
    spec = importlib.util.spec_from_loader("ca_launch", SourceFileLoader("ca_launch", str(LAUNCHER)))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.listen_key("127.0.0.1:18080") == "0100007F:46A0"
    assert mod.listen_key("10.1.2.3:80") == "0302010A:0050"
    for bad in ("localhost:80", "127.0.0.1:0", "127.0.0.1:70000", "1.2.3:80"):
        with pytest.raises(ValueError):
            mod.listen_key(bad)


def test_the_cli_starts_when_something_listens_and_nothing_connects(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        addr = f"127.0.0.1:{listener.getsockname()[1]}"
        done = launch(tmp_path, addr)
        assert (done.returncode, done.stdout) == (0, b"started\n")
        listener.settimeout(0.2)
        with pytest.raises(TimeoutError):
            listener.accept()  # the launcher read /proc/net/tcp: nothing connected to the gate


def test_the_cli_waits_for_a_listener_that_comes_later(tmp_path: Path) -> None:
    port = free_port()
    server: list[socket.socket] = []
    timer = threading.Timer(0.4, lambda: server.append(socket.create_server(("127.0.0.1", port))))
    t = time.monotonic()
    timer.start()
    try:
        done = launch(tmp_path, f"127.0.0.1:{port}")
    finally:
        timer.join()
        for s in server:
            s.close()
    assert (done.returncode, done.stdout) == (0, b"started\n")
    assert time.monotonic() - t >= 0.4


def test_nothing_listening_is_a_launch_error_and_the_cli_never_starts(tmp_path: Path) -> None:
    addr = f"127.0.0.1:{free_port()}"
    done = launch(tmp_path, addr, "0.3")
    assert done.returncode == 3
    assert json.loads(done.stdout) == {"type": "launch_error", "reason": "model_gate_not_listening",
                                       "address": addr, "detail": f"nothing listened on {addr} within 0.3s"}
    assert not (tmp_path / "cli.pid").exists()  # the CLI's pidfile is written just before its exec


def test_a_bad_address_is_a_usage_error(tmp_path: Path) -> None:
    done = launch(tmp_path, "localhost:80")
    assert done.returncode == 3
    assert json.loads(done.stdout) == {"type": "launch_error", "reason": "usage",
                                       "detail": "--await-listen wants HOST:PORT SECONDS, got 'localhost:80' '5'"}


def test_the_launcher_argv_carries_the_wait_before_the_command() -> None:
    spec = LaunchSpec(runtime="pi", argv=["pi", "--mode", "rpc"], cwd="/w", require_files=["/s.jsonl"])
    assert spec.launcher_argv(pidfile="/r/p", await_listen=("127.0.0.1:18080", 20.0)) == [
        "ca-launch", "--pidfile", "/r/p", "--cwd", "/w", "--await-listen", "127.0.0.1:18080", "20",
        "--require-file", "/s.jsonl", "--", "pi", "--mode", "rpc"]
    assert "--await-listen" not in spec.launcher_argv(pidfile="/r/p")


def test_the_handshake_says_the_model_endpoint_never_listened() -> None:
    payload = {"type": "launch_error", "reason": "model_gate_not_listening", "address": "127.0.0.1:18080",
               "detail": "nothing listened on 127.0.0.1:18080 within 20s"}
    failed = NativeSession.launch_failed(None, LaunchError(payload))  # type: ignore[arg-type]
    assert failed.reason == HandshakeReason.MODEL_NOT_LISTENING
    assert json.loads(failed.detail) == payload
