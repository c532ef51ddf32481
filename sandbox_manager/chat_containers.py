"""A chat's container: how it is made (its spec, the chat's state volume, the identity
marker) and how it is proven the recorded one (identity labels, the engine data root, the
configured image, the model gate).

A resolve (``sandbox_manager.sandboxes``), a new sandbox (``sandbox_manager.creation``) and
a replacement or migration (``sandbox_manager.replacement``, ``sandbox_manager.migration``)
need these: the manager inherits them, and the creation and replacement steps take a
:class:`ChatContainers`, so they never need the manager that calls them.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import NamedTuple

import anyio

from images.checks import check_image_labels
from sandbox_manager.disk_bound import DiskBound
from sandbox_manager.engine import ContainerInfo, ContainerSpec, Engine, ImageInfo, Mount, NotFound
from sandbox_manager.identity import (
    LABEL_CHAT,
    LABEL_DATA_ROOT,
    LABEL_HOST,
    LABEL_IDENTITY,
    LABEL_SANDBOX,
    LABEL_USER,
    LostReason,
    SandboxLost,
    container_name,
    digest,
)
from sandbox_manager.integrity import IntegrityFacts
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sealing import MODEL_DIR, MODEL_GATE_COMMAND, MODEL_LISTEN, GateReport, unsealed, wait_gate
from sandbox_manager.uses import ContainerUses
from sandbox_manager.volumes import LABEL_VOLUME_ID, MARKER_PATH, marker_bytes, volume_labels, volume_name
from sandbox_manager.volume_files import put_root_file
from state.records import SandboxRecord
from state.store import Store


class ImageRefused(Exception):
    """The configured image does not carry the pinned versions: no sandbox is created from it."""


class ChatContainers:
    """Making and checking the chats' containers on one engine (the manager inherits these)."""

    def __init__(self, engine: Engine, store: Store, config: SandboxConfig) -> None:
        self.engine = engine
        self.store = store
        self.config = config
        self.uses = ContainerUses()
        # container id -> the StartedAt whose marker this daemon has read (SPEC 15: the mounts
        # of a running container cannot change, so one read per start is enough)
        self._marker_seen: dict[str, str] = {}
        self.disk = DiskBound(engine, store, config.disk_bytes)
        # kept fresh by the engine's events while the supervisor runs IntegrityFacts.follow
        self.integrity = IntegrityFacts(engine)

    async def data_root_id(self) -> str:
        """The engine data root's identity, created on first use: what a new sandbox is labelled
        with. Kept between calls only as the engine's event stream allows (any event of the
        marker volume, an engine restart, a gap in the stream drops it: a data root swapped
        under a running daemon comes with one of those). A turn's check of an existing sandbox
        reads :meth:`current_data_root_id` instead."""
        async def created() -> str:
            ident = await self.engine.data_root_identity(create=True)
            if not ident:
                raise RuntimeError("the engine data root has no identity and none could be created")
            return ident

        return await self.integrity.engine_fact_or("data_root", created)

    async def current_data_root_id(self) -> str | None:
        """Re-read from the engine: the data root may have been swapped. (Only a resident's
        facts carry it between turns, and any event of the marker volume or a stream gap drops them.)"""
        return await self.engine.data_root_identity(create=False)

    def identity_labels(self, user_id: str, chat_id: str, data_root_id: str) -> dict[str, str]:
        return {
            LABEL_SANDBOX: "1",
            LABEL_IDENTITY: digest("sandbox", user_id, chat_id),
            LABEL_USER: digest("user", user_id)[:32],
            LABEL_CHAT: digest("chat", chat_id)[:32],
            LABEL_HOST: self.config.host_id,
            LABEL_DATA_ROOT: data_root_id,
        }

    def socket_dir(self, user_id: str, chat_id: str) -> Path:
        """The host directory holding this sandbox's model socket (mounted at MODEL_DIR)."""
        if self.config.socket_root is None:
            raise ValueError("socket_root: the sandbox manager has no model socket directory configured")
        return Path(self.config.socket_root) / container_name(user_id, chat_id)

    async def gate_ready(self, info: ContainerInfo, since: float) -> GateReport:
        return await wait_gate(self.engine, info, since=since, timeout_s=self.config.gate_ready_timeout_s)

    @property
    def model_endpoint(self) -> tuple[str, float]:
        """What every CLI's launch waits for before the CLI starts (the launcher's
        ``--await-listen``): the model gate listening, within the gate's timeout. A new
        sandbox is handed over without waiting for the gate's line itself."""
        return MODEL_LISTEN, self.config.gate_ready_timeout_s

    async def checked_image(self, ref: str) -> ImageInfo:
        try:
            img = await self.engine.image(ref)
        except NotFound:
            raise ImageRefused(f"image {ref} is not present in the engine") from None
        problems = check_image_labels(img.labels, pins=self.config.pins, require_helper=self.config.require_helper)
        if problems:
            raise ImageRefused(f"image {ref} ({img.id[:19]}) refused: " + "; ".join(problems))
        return img

    async def image_for_new_sandbox(self, ref: str) -> ImageInfo:
        """:meth:`checked_image`, kept between new sandboxes until any image event
        (sandbox_manager.integrity). A refused image is never kept: every call refuses it anew.
        A turn's check of an existing sandbox asks the engine every time."""
        return await self.integrity.engine_fact_or(f"image:{ref}", lambda: self.checked_image(ref))

    def check_identity(self, rec: SandboxRecord, info: ContainerInfo) -> None:
        """The container is the recorded one: same id, the chat's identity labels."""
        if info.id != rec.container_id:
            raise SandboxLost(LostReason.CONTAINER_REPLACED, f"{info.id[:12]} is not {rec.container_id[:12]}")
        want = self.identity_labels(rec.user_id, rec.chat_id, rec.data_root_id)
        bad = sorted(k for k, v in want.items() if info.labels.get(k) != v)
        if bad:
            raise SandboxLost(LostReason.LABELS_MISMATCH, "labels differ: " + ", ".join(bad))

    def saw_marker(self, info: ContainerInfo) -> None:
        self._marker_seen[info.id] = started_at(info)

    def spec(self, user_id: str, chat_id: str, data_root_id: str, image: ImageInfo, volume: str | None) -> ContainerSpec:
        """The chat's container (``volume`` None: the pre-volume shape, kept for the tests of
        the migration; the product always passes the chat's volume)."""
        return ContainerSpec(image=image.id, name=container_name(user_id, chat_id),
                             labels=self.identity_labels(user_id, chat_id, data_root_id),
                             mounts=(Mount(str(self.socket_dir(user_id, chat_id)), MODEL_DIR, read_only=True),),
                             command=MODEL_GATE_COMMAND, memory_bytes=self.config.memory_bytes,
                             pids_limit=self.config.pids_limit, nano_cpus=self.config.nano_cpus, home_volume=volume)

    async def new_volume(self, user_id: str, chat_id: str, data_root_id: str) -> NewVolume:
        """Create the chat's volume with a fresh id. A volume of that name that exists already
        is never adopted: SANDBOX_UNRECORDED (the caller may clear leftovers first)."""
        name = volume_name(container_name(user_id, chat_id))
        volume_id = uuid.uuid4().hex
        labels = volume_labels(self.identity_labels(user_id, chat_id, data_root_id), volume_id)
        got = await self.engine.create_volume(name, labels)
        if got.labels.get(LABEL_VOLUME_ID) != volume_id:  # the engine returned an existing one
            raise SandboxLost(LostReason.SANDBOX_UNRECORDED, f"volume {name} exists without a record")
        return NewVolume(name, volume_id, got.mountpoint)

    async def write_marker(self, container_id: str, user_id: str, chat_id: str, volume_id: str) -> None:
        await self.engine.put_root_file(container_id, MARKER_PATH, _marker(user_id, chat_id, volume_id))

    async def write_marker_on_host(self, volume: NewVolume, user_id: str, chat_id: str) -> bool:
        """The marker written into the new volume's content from the host, before its container
        is first started (sandbox_manager.volume_files); False: use :meth:`write_marker`."""
        return await anyio.to_thread.run_sync(put_root_file, volume.mountpoint, MARKER_PATH,
                                              _marker(user_id, chat_id, volume.volume_id))

    def unsealed(self, rec: SandboxRecord, info: ContainerInfo) -> str | None:
        return unsealed(info, str(self.socket_dir(rec.user_id, rec.chat_id)))


def _marker(user_id: str, chat_id: str, volume_id: str) -> bytes:
    return marker_bytes(digest("sandbox", user_id, chat_id), volume_id)


def started_at(info: ContainerInfo) -> str:
    return str((info.attrs.get("State") or {}).get("StartedAt") or "")


class NewVolume(NamedTuple):
    """A chat's state volume, just created: its name, its random id (label and marker) and
    where the engine keeps its content (None when the engine does not say)."""

    name: str
    volume_id: str
    mountpoint: str | None
