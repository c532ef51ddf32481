"""The model proxy service as a real process (runner/proxy_service.py, runner/proxy_client.py):
started detached from the daemon, attached again, replaced when its configuration or its code
changed, lingering out with no daemon, stopped on request, re-attached (the daemon's view sent
again) after it died, and left serving by a daemon that shuts down; a daemon whose service
cannot start does not start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import anyio
import pytest
import structlog
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client import CollectorRegistry

from proxy import ProxyConfig
from proxy.sockets import UnixListener
from runner.config import load_settings
from runner.model_path import ModelPath
from runner.model_proxy import ModelProxy, ProxyOps
from runner.proxy_client import ProxyServiceClient, ProxyServiceUnavailable, ensure_service, stop_service
from runner.proxy_control import ControlServer
from runner.proxy_link import linked
from runner.proxy_protocol import BUILD_SOURCES, PROJECT_ROOT, HelloResult, ServiceConfig, build_id
from runner.proxy_service import rotate_log
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.store import Store
from tests.support.fake_engine import IMAGE, FakeEngine
from tests.support.proxy_harness import key_file
from tests.support.proxy_services import end_strays, services

pytestmark = pytest.mark.anyio
BUILD = build_id()


@pytest.fixture
def home(tmp_path: Path) -> Iterator[Path]:
    home = tmp_path / "home"
    home.mkdir()
    yield home
    assert end_strays({home}, None) == [], "a test left its service running"


@pytest.fixture
def sockets() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ca-ps-", dir="/tmp"))  # a tmp_path is too long for a socket address
    yield path
    shutil.rmtree(path, ignore_errors=True)


def config(home: Path, linger_s: float = 60.0) -> ServiceConfig:
    return ServiceConfig(home=home, proxy=ProxyConfig(upstream_url="http://127.0.0.1:9", key_file=key_file(home)),
                         store_path=home / "store.db", linger_s=linger_s)


async def hello(cfg: ServiceConfig) -> HelloResult:
    async with linked(cfg.paths.control) as link:
        return await link.hello("operator")


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


async def test_it_starts_detached_is_attached_again_and_stops(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CLOUD_AGENT_GATEWAY_KEY_FILE", "/run/not-for-the-service")
    cfg = config(home)
    assert await ensure_service(cfg, BUILD) == "spawned"
    first = await hello(cfg)
    pid = first.pid
    assert (first.build_id, first.config_digest, first.daemons, first.sandboxes) == (BUILD, cfg.digest(), 0, 0)
    # its own session, not this process's child: the daemon's SIGTERM or kill -9 does not reach it
    assert os.getsid(pid) == pid != os.getsid(0)
    assert int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]) != os.getpid()
    # the one service of this home (other daemons on the machine, a bench's, have their own)
    assert {p: h for p, h in services().items() if h == home} == {pid: home}
    assert (cfg.paths.pid.read_text(), oct(cfg.paths.directory.stat().st_mode & 0o777),
            oct(cfg.paths.control.stat().st_mode & 0o777)) == (f"{pid}\n", "0o700", "0o600")
    # its configuration came on stdin: not in its arguments, nor any CLOUD_AGENT_* of the daemon's
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    assert argv[1:] == [b"-m", b"runner.proxy_service", b"--home", str(home).encode(), b""]
    assert b"CLOUD_AGENT_" not in Path(f"/proc/{pid}/environ").read_bytes()
    assert await ensure_service(cfg, BUILD) == "attached"
    assert (await hello(cfg)).pid == pid
    assert await stop_service(cfg.paths) == pid
    assert not alive(pid) and not cfg.paths.control.exists() and not cfg.paths.pid.exists()
    assert await stop_service(cfg.paths) is None  # none runs: nothing to stop
    log = cfg.paths.log.read_text()
    assert '"event": "proxy_service.stop_requested"' in log and '"reason": "stop"' in log


async def test_another_configuration_replaces_it(home: Path) -> None:
    assert await ensure_service(config(home, linger_s=60.0), BUILD) == "spawned"
    old = (await hello(config(home))).pid
    cfg = config(home, linger_s=61.0)  # e.g. the embedded fixture came back on another port
    assert await ensure_service(cfg, BUILD) == "replaced"
    new = await hello(cfg)
    assert new.pid != old and not alive(old) and new.config_digest == cfg.digest()
    await stop_service(cfg.paths)


async def test_another_build_is_replaced(home: Path) -> None:
    """A service of an older build (here one in this process, claiming another build id) is
    stopped, and one running this build takes its place."""
    cfg = config(home)
    store = Store(cfg.store_path)
    registry = CollectorRegistry()
    outcome: list[str] = []
    try:
        async with anyio.create_task_group() as tg, ModelProxy(cfg.proxy, store, registry=registry) as proxy:
            async def older() -> None:
                outcome.append(await ControlServer(cfg, proxy, build_id="an-older-build", registry=registry).serve())

            tg.start_soon(older)
            with anyio.fail_after(10):
                while not cfg.paths.control.exists():
                    await anyio.sleep(0.01)
            assert (await hello(cfg)).build_id == "an-older-build"
            assert await ensure_service(cfg, BUILD) == "replaced"
        assert outcome == ["stop"]
        current = await hello(cfg)
        assert (current.build_id, current.pid != os.getpid()) == (BUILD, True)
    finally:
        store.close()
    await stop_service(cfg.paths)


async def test_a_service_whose_hello_this_build_cannot_read_is_replaced(home: Path) -> None:
    """An older service's hello may not parse here: it is asked to stop all the same."""
    cfg = config(home)
    cfg.paths.prepare()
    listener = UnixListener(cfg.paths.control, 0o600)
    asked: list[str] = []

    async def ancient() -> None:
        while True:
            stream = await listener.accept()
            buffered = BufferedByteReceiveStream(stream)
            try:
                while True:
                    line = json.loads(await buffered.receive_until(b"\n", 65536))
                    asked.append(line["request"]["op"])
                    result = {"version": 1} if line["request"]["op"] == "hello" else {}
                    await stream.send(json.dumps({"id": line["id"], "ok": True, "result": result}).encode() + b"\n")
                    if line["request"]["op"] == "stop":
                        listener.close()
                        return
            except anyio.IncompleteRead:
                pass
            finally:
                await stream.aclose()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ancient)
        assert await ensure_service(cfg, BUILD) == "replaced"
    assert asked == ["hello", "stop"]
    assert (await hello(cfg)).build_id == BUILD
    await stop_service(cfg.paths)


async def test_it_lingers_out_with_no_daemon_attached(home: Path) -> None:
    cfg = config(home, linger_s=0.5)
    await ensure_service(cfg, BUILD)
    pid = (await hello(cfg)).pid
    with anyio.fail_after(15):
        while alive(pid):
            await anyio.sleep(0.05)
    assert '"event": "proxy_service.lingered_out"' in cfg.paths.log.read_text()
    assert not cfg.paths.control.exists()


async def test_a_daemon_attaches_again_and_resends_its_view_after_the_service_died(home: Path,
                                                                                  sockets: Path) -> None:
    cfg = config(home)
    replays: list[int] = []

    async def replay(ops: ProxyOps) -> None:  # what ModelPath sends: the sockets it opened
        replays.append(1)
        if len(replays) > 1:
            await ops.open("ca-chat-a", "u1", "c1", sockets / "a")

    client = ProxyServiceClient(cfg, replay=replay)
    async with anyio.create_task_group() as tg:
        await tg.start(client.run)
        path = await client.open("ca-chat-a", "u1", "c1", sockets / "a")
        assert client.service is not None
        dead = client.service.pid
        os.kill(dead, signal.SIGKILL)
        with anyio.fail_after(30):
            while client.service is None or client.service.pid == dead:
                await anyio.sleep(0.05)
        again = await hello(cfg)
        assert (len(replays), again.daemons, again.sandboxes) == (2, 1, 1)
        assert path.exists()  # at the same path, in the new service
        await client.flush("ca-chat-a", 1.0)
        tg.cancel_scope.cancel()
    assert (await hello(cfg)).daemons == 0  # this "daemon" left; the service serves on
    await stop_service(cfg.paths)


async def test_a_daemon_that_shuts_down_leaves_the_service_serving(home: Path, sockets: Path) -> None:
    settings = load_settings({"CLOUD_AGENT_HOME": str(home), "CLOUD_AGENT_SOCKET_DIR": str(sockets)})
    store = Store(settings.store_path)
    manager = SandboxManager(FakeEngine(), store, SandboxConfig(image=IMAGE, socket_root=str(sockets)))  # type: ignore[arg-type]
    path = ModelPath(settings, "http://127.0.0.1:9", store, manager)
    try:
        async with path.running():
            socket = await path.open("u1", "c1")
            serving = await hello(ServiceConfig(home=home, proxy=path.config, store_path=settings.store_path,
                                                linger_s=settings.proxy_linger_s))
            assert (serving.daemons, serving.sandboxes) == (1, 1)
        cfg = ServiceConfig(home=home, proxy=path.config, store_path=settings.store_path,
                            linger_s=settings.proxy_linger_s)
        after = await hello(cfg)
        assert (after.pid, after.daemons, after.sandboxes) == (serving.pid, 0, 1) and socket.exists()
    finally:
        store.close()
    await stop_service(cfg.paths)


async def test_a_daemon_whose_service_cannot_start_does_not_start(home: Path, sockets: Path) -> None:
    (home / "proxy").write_text("in the way of the service's directory\n")
    settings = load_settings({"CLOUD_AGENT_HOME": str(home), "CLOUD_AGENT_SOCKET_DIR": str(sockets)})
    store = Store(settings.store_path)
    manager = SandboxManager(FakeEngine(), store, SandboxConfig(image=IMAGE, socket_root=str(sockets)))  # type: ignore[arg-type]
    try:
        with pytest.raises(ProxyServiceUnavailable, match=r"the model proxy service: .*File exists: '.*/proxy'"):
            async with ModelPath(settings, "http://127.0.0.1:9", store, manager).running():
                pytest.fail("the model path runs without its proxy")
    finally:
        store.close()


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """runner.cli.main configures structlog onto this test's captured stderr: put it back."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_an_operator_sees_and_stops_the_service(home: Path, monkeypatch: pytest.MonkeyPatch, logging_restored: None,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from runner.cli import main

    monkeypatch.setenv("CLOUD_AGENT_HOME", str(home))
    assert main(["proxy-service", "status"]) == 1
    assert capsys.readouterr().err == f"no model proxy service answers at {home}/proxy/control.sock\n"
    cfg = config(home)
    assert anyio.run(ensure_service, cfg, BUILD) == "spawned"
    assert main(["proxy-service", "status"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert (status["build_id"], status["daemons"], status["in_flight"], status["sandboxes"]) == (BUILD, 0, 0, 0)
    assert main(["proxy-service", "stop"]) == 0
    assert capsys.readouterr().out == f"stopped the model proxy service (pid {status['pid']})\n"
    assert not alive(status["pid"])


def test_its_log_is_rotated_past_the_limit_and_only_its_own(tmp_path: Path) -> None:
    log, other = tmp_path / "service.log", tmp_path / "elsewhere.log"
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    foreign = os.open(other, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        os.write(fd, b"x" * 100)
        assert not rotate_log(log, (fd,), limit=100)  # not over it yet
        assert not rotate_log(log, (foreign,), limit=10)  # its output goes elsewhere (a process manager's)
        assert rotate_log(log, (fd,), limit=10)
        os.write(fd, b"after\n")
        assert ((tmp_path / "service.log.1").read_bytes(), log.read_bytes()) == (b"x" * 100, b"after\n")
        assert oct(log.stat().st_mode & 0o777) == "0o600"
    finally:
        os.close(fd)
        os.close(foreign)


def test_the_build_id_covers_every_file_the_service_runs(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import sys, runner.proxy_service\n"
                          "print('\\n'.join(m.__file__ for m in list(sys.modules.values()) "
                          "if getattr(m, '__file__', None)))"],
                         cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout.split()
    ours = sorted({Path(f).resolve().relative_to(PROJECT_ROOT) for f in out
                   if Path(f).resolve().is_relative_to(PROJECT_ROOT) and ".venv" not in Path(f).parts})
    uncovered = [str(p) for p in ours if not any(str(p) == s or p.parts[0] == s for s in BUILD_SOURCES)]
    assert ours and uncovered == []
    # a change to one of them is another build
    copy = tmp_path / "copy"
    for name in BUILD_SOURCES:
        src = PROJECT_ROOT / name
        if src.is_dir():
            shutil.copytree(src, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, copy / name)
    assert build_id(copy) == BUILD
    with (copy / "proxy" / "exchange.py").open("a") as fh:
        fh.write("# changed\n")
    assert build_id(copy) != BUILD
