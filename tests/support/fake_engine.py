"""An in-memory container engine (the :class:`sandbox_manager.engine.Engine` seam) for unit tiers
that run the real sandbox manager and store without Docker.

Containers and state volumes are records (a volume's files are what the manager writes into it
through a container mounting it, e.g. the identity marker); an attached exec is a :class:`FakeStream` that a fake driver's session
may ignore; every call is logged in :attr:`FakeEngine.calls` so a test can prove what ran.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from images.pins import load_pins
from sandbox_manager.engine import AGENT_HOME, ContainerInfo, ContainerSpec, EngineError, FileEntry, ImageInfo, NotFound, VolumeInfo

IMAGE = "cloud-agent-sandbox:fake"
IMAGE_ID = "sha256:" + "ab" * 32


class FakeStream:
    """The attached stream of a process that writes nothing; ``alive`` until closed or killed."""

    def __init__(self, exec_id: str) -> None:
        self.exec_id = exec_id
        self.sent: list[bytes] = []
        self.raw: list[bytes] = []
        self.closed = False

    @property
    def alive(self) -> bool:
        return not self.closed

    async def send(self, line: bytes) -> None:
        self.sent.append(line)

    async def send_raw(self, data: bytes) -> None:
        self.raw.append(data)  # a launch's files, sent first (sandbox_manager.launch_files)

    async def receive(self) -> bytes | None:
        return None  # nothing to read: end of stream as soon as anyone asks

    async def close(self) -> None:
        self.closed = True

    async def aclose(self) -> None:
        self.closed = True

    def diagnostics(self) -> str:
        return ""


class RefusingEngine:
    """Enough engine for a supervisor whose turns never reach a container: its image has no
    pins, so every turn is refused before one would be made, and it has no sandboxes."""

    async def image(self, ref: str) -> ImageInfo:
        return ImageInfo(id="sha256:" + "0" * 64, labels={}, tags=(ref,))

    async def list_labelled(self, label: str) -> list[ContainerInfo]:
        return []


@dataclass
class FakeEngine:
    labels: dict[str, str] = field(default_factory=lambda: load_pins().labels(with_helper=True))
    data_root: str | None = "root-1"
    containers: dict[str, ContainerInfo] = field(default_factory=dict)  # by id
    streams: list[FakeStream] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    volumes: dict[str, VolumeInfo] = field(default_factory=dict)  # by name
    volume_files: dict[str, dict[str, bytes]] = field(default_factory=dict)  # volume -> path -> content

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
        mounts = [{"Type": "bind", "Source": m.source, "Destination": m.target, "RW": not m.read_only}
                  for m in spec.mounts]
        if spec.home_volume:
            if spec.home_volume not in self.volumes:  # the engine would make an unlabelled one
                self.volumes[spec.home_volume] = VolumeInfo(name=spec.home_volume, labels={})
            mounts.append({"Type": "volume", "Name": spec.home_volume, "Destination": AGENT_HOME, "RW": True})
        attrs = {"HostConfig": {"NetworkMode": "none"}, "Mounts": mounts, "Config": {"Cmd": list(spec.command)}}
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

    async def wait_log_line(self, container_id: str, needle: str, *, since: float, timeout_s: float) -> str | None:
        info = self._get(container_id)
        self.calls.append("wait_log_line")
        # the fake container's command (ca-modelgate) reports listening at once, with the
        # volume's marker when started with --marker, as the real one does
        said: dict[str, Any] = {"event": "modelgate.listening"}
        cmd = info.attrs.get("Config", {}).get("Cmd") or []
        if "--marker" in cmd:
            raw = self.volume_files.get(self._home_volume(container_id) or "", {}).get(cmd[cmd.index("--marker") + 1])
            said["marker"] = raw.decode() if raw is not None else None
        return json.dumps(said)

    async def put_files(self, container_id: str, files: list[FileEntry], dirs: list[str]) -> None:
        self._get(container_id)
        self.calls.append("put_files")

    async def rename(self, container_id: str, name: str) -> None:
        self.calls.append("rename")
        info = self._get(container_id)
        self.containers[info.id] = ContainerInfo(id=info.id, name=name, status=info.status, image_id=info.image_id,
                                                 labels=info.labels, attrs=info.attrs)

    # -- state volumes

    def _home_volume(self, container_id: str) -> str | None:
        for m in self._get(container_id).attrs.get("Mounts") or []:
            if m.get("Destination") == AGENT_HOME and m.get("Type") == "volume":
                return m["Name"]
        return None

    async def create_volume(self, name: str, labels: dict[str, str]) -> VolumeInfo:
        self.calls.append("create_volume")
        return self.volumes.setdefault(name, VolumeInfo(name=name, labels=dict(labels)))  # an existing one unchanged

    async def inspect_volume(self, name: str) -> VolumeInfo:
        if name not in self.volumes:
            raise NotFound(name)
        return self.volumes[name]

    async def remove_volume(self, name: str) -> None:
        self.calls.append("remove_volume")
        if name not in self.volumes:
            raise NotFound(name)
        if any(self._home_volume(cid) == name for cid in self.containers):
            raise EngineError(f"volume {name} is in use")  # as the engine refuses it
        del self.volumes[name]
        self.volume_files.pop(name, None)

    async def list_volumes(self, label: str) -> list[VolumeInfo]:
        key, _, value = label.partition("=")
        return [v for v in self.volumes.values() if v.labels.get(key) == value]

    async def read_file(self, container_id: str, path: str) -> bytes:
        self.calls.append("read_file")
        volume = self._home_volume(container_id)
        try:
            return self.volume_files[volume or ""][path]
        except KeyError:
            raise NotFound(path) from None

    async def put_root_file(self, container_id: str, path: str, content: bytes, mode: int = 0o444) -> None:
        self.calls.append("put_root_file")
        volume = self._home_volume(container_id)
        if volume is None or not path.startswith(AGENT_HOME + "/"):
            raise EngineError(f"the fake engine keeps files on a home volume only, not {path}")
        self.volume_files.setdefault(volume, {})[path] = content

    async def copy_tree(self, src_container: str, path: str, dst_container: str) -> None:
        self.calls.append("copy_tree")
        src, dst = self._home_volume(src_container), self._home_volume(dst_container)
        for p, content in dict(self.volume_files.get(src or "", {})).items():
            if dst is not None and p.startswith(path.rstrip("/") + "/"):
                self.volume_files.setdefault(dst, {})[p] = content
