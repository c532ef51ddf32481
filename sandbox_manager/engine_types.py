"""The engine seam's records: what a container is made from and what the engine answers
about containers, images and volumes (Docker's inspect documents read into them).

Split from ``sandbox_manager.engine`` (which re-exports them): the SDK's and the straight
socket reads (``engine_reads``) both build these from the same documents.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class Mount:
    """A host directory bind-mounted into the container."""

    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerSpec:
    image: str
    name: str
    labels: dict[str, str]
    mounts: tuple[Mount, ...] = ()
    user: str = "agent"
    workdir: str = "/home/agent/workspace"
    memory_bytes: int = 4 * 1024**3
    pids_limit: int = 1024
    nano_cpus: int = 2_000_000_000
    disk_bytes: int | None = None  # a writable-layer quota (storage drivers that support one)
    command: tuple[str, ...] = ("sleep", "infinity")
    home_volume: str | None = None  # a named volume mounted read-write at the agent's home (SPEC 15)


@dataclass(frozen=True)
class ContainerInfo:
    id: str
    name: str
    status: str  # created | running | exited | paused ...
    image_id: str
    labels: dict[str, str]
    attrs: dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def running(self) -> bool:
        return self.status == "running"

    @property
    def started_ns(self) -> int | None:
        """When the engine last started it (``State.StartedAt``), ns since the epoch; None unknown."""
        return rfc3339_ns(str(self.attrs.get("State", {}).get("StartedAt") or ""))

    @property
    def init_pid(self) -> int | None:
        """Its init as a host pid (``State.Pid``); None when not known or not running (0)."""
        return self.attrs.get("State", {}).get("Pid") or None


@dataclass(frozen=True)
class ImageInfo:
    id: str
    labels: dict[str, str]
    tags: tuple[str, ...]


@dataclass(frozen=True)
class VolumeInfo:
    name: str
    labels: dict[str, str]
    mountpoint: str | None = None  # where the engine keeps its content (local driver: under the data root)


@dataclass(frozen=True)
class FileEntry:
    path: str
    content: bytes
    mode: int = 0o644


def container_info(attrs: dict[str, Any]) -> ContainerInfo:
    """A container's inspect document as the SDK's Container reads it (id, name, status)."""
    state = attrs.get("State")
    status = state.get("Status", "") if isinstance(state, dict) else str(state or "")
    return ContainerInfo(id=attrs["Id"], name=(attrs.get("Name") or "").lstrip("/"), status=status,
                         image_id=attrs.get("Image", ""), labels=dict(attrs.get("Config", {}).get("Labels") or {}),
                         attrs=attrs)


def rfc3339_ns(stamp: str) -> int | None:
    """The engine's RFC 3339 time (UTC, up to nanoseconds) as ns since the epoch."""
    day, _, frac = stamp.rstrip("Z").partition(".")
    try:
        seconds = int(datetime.fromisoformat(day + "+00:00").timestamp())
    except ValueError:
        return None
    digits = (frac + "000000000")[:9]
    return seconds * 1_000_000_000 + int(digits) if digits.isdigit() and seconds > 0 else None
