"""An in-memory container engine (the :class:`sandbox_manager.engine.Engine` seam) for unit tiers
that run the real sandbox manager and store without Docker.

Containers are records; an attached exec is a :class:`FakeStream` that a fake driver's session
may ignore; every call is logged in :attr:`FakeEngine.calls` so a test can prove what ran.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from images.pins import load_pins
from sandbox_manager.engine import ContainerInfo, ContainerSpec, FileEntry, ImageInfo, NotFound

IMAGE = "cloud-agent-sandbox:fake"
IMAGE_ID = "sha256:" + "ab" * 32


class FakeStream:
    """The attached stream of a process that writes nothing; ``alive`` until closed or killed."""

    def __init__(self, exec_id: str) -> None:
        self.exec_id = exec_id
        self.sent: list[bytes] = []
        self.closed = False

    @property
    def alive(self) -> bool:
        return not self.closed

    async def send(self, line: bytes) -> None:
        self.sent.append(line)

    async def receive(self) -> bytes | None:
        return None  # nothing to read: end of stream as soon as anyone asks

    async def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True

    def diagnostics(self) -> str:
        return ""


@dataclass
class FakeEngine:
    labels: dict[str, str] = field(default_factory=lambda: load_pins().labels(with_helper=True))
    data_root: str | None = "root-1"
    containers: dict[str, ContainerInfo] = field(default_factory=dict)  # by id
    streams: list[FakeStream] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)

    def _get(self, ref: str) -> ContainerInfo:
        for info in self.containers.values():
            if ref in (info.id, info.name):
                return info
        raise NotFound(ref)

    def _set_status(self, container_id: str, status: str) -> None:
        info = self._get(container_id)
        self.containers[info.id] = ContainerInfo(id=info.id, name=info.name, status=status, image_id=info.image_id,
                                                 labels=info.labels, attrs=info.attrs)

    async def ping(self) -> bool:
        return True

    async def version(self) -> dict[str, Any]:
        return {"Version": "fake", "ApiVersion": "1.41"}

    async def data_root_identity(self, *, create: bool) -> str | None:
        return self.data_root

    async def image(self, ref: str) -> ImageInfo:
        self.calls.append("image")
        return ImageInfo(id=IMAGE_ID, labels=dict(self.labels), tags=(IMAGE,))

    async def create(self, spec: ContainerSpec) -> ContainerInfo:
        self.calls.append("create")
        # what the manager's seal check reads back: network none and the model socket mount
        attrs = {"HostConfig": {"NetworkMode": "none"},
                 "Mounts": [{"Source": m.source, "Destination": m.target, "RW": not m.read_only} for m in spec.mounts]}
        info = ContainerInfo(id=uuid.uuid4().hex * 2, name=spec.name, status="created", image_id=IMAGE_ID,
                             labels=dict(spec.labels), attrs=attrs)
        self.containers[info.id] = info
        return info

    async def inspect(self, container_id: str) -> ContainerInfo:
        return self._get(container_id)

    async def start(self, container_id: str) -> None:
        self.calls.append("start")
        self._set_status(container_id, "running")

    async def stop(self, container_id: str, timeout_s: int = 5) -> None:
        self.calls.append("stop")
        self._set_status(container_id, "exited")

    async def remove(self, container_id: str) -> None:
        self.calls.append("remove")
        del self.containers[self._get(container_id).id]

    async def list_labelled(self, label: str) -> list[ContainerInfo]:
        key, _, value = label.partition("=")
        return [c for c in self.containers.values() if c.labels.get(key) == value]

    async def exec_run(self, container_id: str, argv: list[str], *, user: str = "agent",
                       env: dict[str, str] | None = None, workdir: str | None = None) -> tuple[int, bytes]:
        self._get(container_id)
        self.calls.append("exec_run")
        return 0, b""

    async def exec_attached(self, container_id: str, argv: list[str], *, user: str = "agent",
                            env: dict[str, str] | None = None, workdir: str | None = None) -> Any:
        self._get(container_id)
        self.calls.append("exec_attached")
        stream = FakeStream(uuid.uuid4().hex)
        self.streams.append(stream)
        return stream

    async def exec_exit_code(self, exec_id: str) -> int | None:
        return None

    async def wait_log_line(self, container_id: str, needle: str, *, since: float, timeout_s: float) -> bool:
        self._get(container_id)
        self.calls.append("wait_log_line")
        return True  # the fake container's command (ca-modelgate) reports listening at once

    async def put_files(self, container_id: str, files: list[FileEntry], dirs: list[str]) -> None:
        self._get(container_id)
        self.calls.append("put_files")
