"""The shared harness of the driver integration tests (tests/cli/test_{claude,codex,pi,bridge}_driver.py).

Each test module runs one sealed container of the pinned image (network none, ``--init``,
user ``agent`` = uid 1000; its command ``ca-modelgate``, tests/support/sealed.py) with a host
directory bind-mounted at the same absolute path. Each test gets a ``box``: a fresh loopback
fixture behind a model proxy on the container's socket (the CLI holds a placeholder, the proxy
the box's ``key``) and a directory of its own under that root, where members live.
CLIs start through ``ca-launch`` and ``docker exec -i``, so their paths are the host's.

A test module subclasses :class:`DriverBox` as its ``Box`` (class attributes ``key``, ``api``,
``shared_workspace``; a ``start`` for its driver) and gets its ``root``, ``container`` and
``box`` fixtures from :func:`box_fixtures`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from deploy.loopback import LoopbackFixture, Message
from drivers.base import NativeSession
from drivers.launch import LaunchSpec
from drivers.models import GatewayConfig, MemberPaths, Settlement
from drivers.transport import Transport, unwrap
from tests.support.local_process import LocalProcessTransport
from tests.support.replay import Entry, RecordingTransport
from tests.support.sealed import MODELGATE_COMMAND, sealed_proxy, sealed_volumes

AGENT_UID = 1000  # the image's user ``agent``


class DriverBox:
    """One test's directory in the module's container; members live under ``root``."""

    key: ClassVar[str]  # the gateway key (a canary: it must never show up where it should not)
    model: ClassVar[str] = "fixture-model"
    api: ClassVar[str | None] = None  # the loopback API whose conversations dialogue() reads
    shared_workspace: ClassVar[bool] = False  # members share root/ws (a chat's workspace)

    def __init__(self, container: Any, root: Path, fx: LoopbackFixture, name: str) -> None:
        self.container, self.root, self.fx, self.name = container, root, fx, name
        self.gateway = GatewayConfig(base_url=fx.base_url, key=self.key, model=self.model)
        self.procs: list[tuple[LocalProcessTransport, Path]] = []
        self._n = 0

    def member(self, name: str, workspace: str | None = None) -> MemberPaths:
        base = self.root / name
        ws = workspace or str(self.root / "ws" if self.shared_workspace else base / "ws")
        return MemberPaths(home=str(base / "home"), workspace=ws, run_dir=str(base / "run"))

    def exec(self, *argv: str) -> str:
        rc, out = self.container.exec_run(list(argv), user="agent")
        assert rc == 0, out
        return out.decode()

    def _own(self) -> None:
        # Files the harness writes as root must be usable by the image's uid 1000.
        for dirpath, dirnames, filenames in os.walk(self.root):
            for name in [*dirnames, *filenames]:
                os.lchown(os.path.join(dirpath, name), AGENT_UID, AGENT_UID)
        os.chown(self.root, AGENT_UID, AGENT_UID)

    def next_run_dir(self, paths: MemberPaths) -> Path:
        """The run dir the next :meth:`launch` of this box uses."""
        return Path(paths.run_dir) / f"p{self._n + 1}"

    async def launch(self, spec: LaunchSpec, paths: MemberPaths, log: list[Entry] | None = None, *,
                     setup_workspace: Callable[[Path], None] | None = None) -> Transport:
        """Start ``spec`` in the container; with ``log``, wrapped in a :class:`RecordingTransport`.
        ``setup_workspace(ws)`` runs once the written files are owned by uid 1000."""
        spec.materialize_files_locally()
        if setup_workspace is not None:
            self._own()
            setup_workspace(Path(paths.workspace))
        run_dir = self.next_run_dir(paths)
        self._n += 1
        run_dir.mkdir(parents=True)
        self._own()
        t = await LocalProcessTransport.start(spec, launcher=("ca-launch",), run_dir=run_dir,
                                              exec_prefix=("docker", "exec", "-i", "-u", "agent", self.container.id))
        self.procs.append((t, run_dir))
        return RecordingTransport(t, log) if log is not None else t

    def _kill_group(self, run_dir: Path) -> None:
        pgid = (run_dir / "cli.pid").read_text().strip()
        self.container.exec_run(["kill", "-KILL", "--", f"-{pgid}"], user="agent")

    async def kill(self, session: NativeSession) -> None:
        """SIGKILL the CLI's process group *inside* the container (host pids differ)."""
        inner = unwrap(session.transport)
        assert isinstance(inner, LocalProcessTransport)
        self._kill_group(next(r for t, r in self.procs if t is inner))
        with anyio.move_on_after(10):
            await inner.wait()
        await inner.close()

    async def stop(self, session: NativeSession) -> int | None:
        """Graceful retirement: stdin EOF, the CLI exits on its own."""
        await session.close()
        inner = unwrap(session.transport)
        assert isinstance(inner, LocalProcessTransport)
        with anyio.move_on_after(15):
            return await inner.wait()
        return None

    async def until_stalled(self) -> None:
        """Until the fixture has begun a ``stall`` answer (the CLI is mid-turn)."""
        await anyio.to_thread.run_sync(lambda: self.fx.wait_for(lambda rs: any(r.action == "stall" for r in rs), 30))

    async def shutdown(self) -> None:
        for t, run_dir in self.procs:
            if t.returncode is None:
                try:
                    self._kill_group(run_dir)
                except OSError:
                    pass
                await t.close()
                with anyio.move_on_after(10):
                    await t.wait()

    def dialogue(self, index: int = -1) -> list[Message]:
        return self.fx.conversation_requests(api=self.api)[index].dialogue()

    def last_user_text(self) -> str:
        return [m for m in self.dialogue() if m.role == "user"][-1].text


def box_fixtures(tag: str, box_cls: type[DriverBox], *, image: str = "sandbox_image",
                 mounts: dict[str, dict[str, str]] | None = None, name_sep: str = "_") -> tuple[Any, Any, Any]:
    """The ``root``, ``container`` and ``box`` fixtures of one test module:
    ``root, container, box = box_fixtures("codex", Box)``.

    ``image`` names the fixture that gives the image tag; ``mounts`` are extra volumes;
    a test's directory is its node name with ``[`` as ``name_sep`` and ``]`` dropped.
    """

    @pytest.fixture(scope="module", name="root")
    def root_fixture():
        path = Path(tempfile.mkdtemp(prefix=f"ca-{tag}-", dir="/var/tmp"))  # not /tmp: Codex warns there
        path.chmod(0o755)  # uid 1000 in the container must traverse it
        yield path
        shutil.rmtree(path, ignore_errors=True)

    @pytest.fixture(scope="module", name="container")
    def container_fixture(docker_client, root, request):
        volumes = {str(root): {"bind": str(root), "mode": "rw"}, **sealed_volumes(root / ".model"),
                   **(mounts or {})}
        c = docker_client.containers.run(request.getfixturevalue(image), MODELGATE_COMMAND, detach=True,
                                         init=True, network_mode="none", user="agent", volumes=volumes,
                                         labels={"cloud-agent.test": f"{tag}-driver"})
        yield c
        c.remove(force=True)

    @pytest.fixture(name="box")
    async def box_fixture(container, root, request):
        name = request.node.name.replace("[", name_sep).replace("]", "")
        with LoopbackFixture.start(port=0) as fx:
            async with sealed_proxy(fx.base_url, root / ".model", key=box_cls.key) as gate:
                b = box_cls(container, root / name, fx, name)
                b.gateway = gate.gateway(model=b.model)
                b.root.mkdir(parents=True)
                try:
                    yield b
                finally:
                    with anyio.CancelScope(shield=True):
                        await b.shutdown()

    return root_fixture, container_fixture, box_fixture


def ok(outcome: Any) -> Settlement:
    assert isinstance(outcome, Settlement), outcome
    assert not outcome.is_error, outcome
    return outcome
