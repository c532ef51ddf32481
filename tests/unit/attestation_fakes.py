"""Fakes for the attestation unit tests: an in-memory engine and a minimal supervisor."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio

from images.pins import load_pins
from runner.attestation import Attestor, SourceIdentity
from runner.housekeeping import Heartbeat
from sandbox_manager.engine import ContainerInfo, ContainerSpec, EngineError, ImageInfo, NotFound
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.store import Store

IMAGE = "cloud-agent-sandbox:fake"


def pinned_labels(helper: str | None = None) -> dict[str, str]:
    labels = load_pins().labels(with_helper=True)
    if helper is not None:
        labels[load_pins().helper.name] = helper
    return labels


@dataclass
class FakeEngine:
    labels: dict[str, str] = field(default_factory=pinned_labels)
    reachable: bool = True
    fail: dict[str, Exception] = field(default_factory=dict)  # method name -> exception
    hang: set[str] = field(default_factory=set)  # method names that never return
    create_then_raise: bool = False  # the container exists, but create() reports an error
    exec_output: bytes = b"1000\n"
    helper_output: bytes = b"4\n"
    data_root: str | None = "root-1"
    containers: dict[str, ContainerInfo] = field(default_factory=dict)  # by name
    calls: list[str] = field(default_factory=list)

    async def _enter(self, name: str) -> None:
        self.calls.append(name)
        if name in self.hang:
            await anyio.sleep(3600)
        if name in self.fail:
            raise self.fail[name]

    async def ping(self) -> bool:
        await self._enter("ping")
        return self.reachable

    async def version(self) -> dict[str, Any]:
        await self._enter("version")
        if not self.reachable:
            raise EngineError("connection refused")
        return {"Version": "20.10.24", "ApiVersion": "1.41"}

    async def data_root_identity(self, *, create: bool) -> str | None:
        return self.data_root

    async def image(self, ref: str) -> ImageInfo:
        await self._enter("image")
        if not self.reachable:
            raise EngineError("connection refused")
        return ImageInfo(id="sha256:" + "ab" * 32, labels=dict(self.labels), tags=(IMAGE,))

    def add(self, name: str, labels: dict[str, str], created: datetime) -> ContainerInfo:
        info = ContainerInfo(id=uuid.uuid4().hex * 2, name=name, status="created", image_id="sha256:" + "ab" * 32,
                             labels=labels, attrs={"Created": created.strftime("%Y-%m-%dT%H:%M:%S.%f") + "123Z"})
        self.containers[name] = info
        return info

    async def create(self, spec: ContainerSpec) -> ContainerInfo:
        self.calls.append("create")
        info = self.add(spec.name, spec.labels, datetime.now(UTC))
        self.last_spec = spec
        if self.create_then_raise:
            raise EngineError("create: timed out reading the answer")
        return info

    def _find(self, ref: str) -> str:
        for name, info in self.containers.items():
            if ref in (name, info.id):
                return name
        raise NotFound(ref)

    async def start(self, container_id: str) -> None:
        await self._enter("start")
        self._find(container_id)

    async def remove(self, container_id: str) -> None:
        await self._enter("remove")
        del self.containers[self._find(container_id)]

    async def list_labelled(self, label: str) -> list[ContainerInfo]:
        key, _, value = label.partition("=")
        return [c for c in self.containers.values() if c.labels.get(key) == value]

    async def exec_run(self, container_id: str, argv: list[str], **kw: Any) -> tuple[int, bytes]:
        self._find(container_id)
        if argv[0] == "ca-launch":
            await self._enter("exec")
            return 0, self.exec_output
        await self._enter("helper")
        return 0, self.helper_output


def make_attestor(tmp: Path, engine: FakeEngine, *, sha: str | None = "a" * 40, probe_interval_s: float = 60,
                  probe_timeout_s: float = 5, beat_age_s: float | None = 0.0,
                  beat_interval_s: float = 10) -> Attestor:
    store = Store(tmp / "store.db")
    manager = SandboxManager(engine, store, SandboxConfig(image=IMAGE, host_id="host-a"))  # type: ignore[arg-type]
    hb = Heartbeat(interval_s=beat_interval_s)
    if beat_age_s is not None:
        hb.last_beat, hb.beats = datetime.now(UTC) - timedelta(seconds=beat_age_s), 1
    sup = SimpleNamespace(engine=engine, manager=manager, heartbeat=hb, owner="owner-1",
                          started_at=datetime.now(UTC), pool=[], store=store)
    source = SourceIdentity(sha=sha, dirty=False if sha else None, origin="git" if sha else "unknown",
                            read_at=datetime.now(UTC))
    return Attestor(sup, probe_interval_s=probe_interval_s, probe_timeout_s=probe_timeout_s,  # type: ignore[arg-type]
                    source=source)
