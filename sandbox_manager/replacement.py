"""Replacing a chat's container on its state volume (SPEC 15): recreation after a loss, and
the upgrade to the configured image.

The volume has been checked (labels) by the caller; the new container's marker is read
before it ever starts. The old container goes only after the turns that use it ended and
its resident processes were retired (``BeforeReplace``); the new one takes the chat's name,
free by then. Interrupted half-way, the record still names the old container (gone or not)
and the next resolve redoes the step: a leftover container of ours under the chat's name is
removed first (:func:`clear_leftover`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import structlog

from sandbox_manager.chat_containers import ChatContainers
from sandbox_manager.engine import ContainerInfo, ImageInfo, NotFound
from sandbox_manager.identity import LostReason, Replaced, SandboxLost, container_name
from sandbox_manager.volumes import check_marker, mounted_home
from state.contract import now
from state.records import SandboxRecord, SandboxState

log = structlog.get_logger("sandbox")

# Called with the old container's id before a replacement removes it: retire its residents.
BeforeReplace = Callable[[str], Awaitable[object]]


@dataclass(frozen=True)
class Replacement:
    """A new container on the chat's volume, recorded and started."""

    record: SandboxRecord
    container: ContainerInfo
    why: Replaced
    replaced_image_id: str  # the image of the container it replaced


async def retire_old(manager: ChatContainers, info: ContainerInfo, before_replace: BeforeReplace) -> None:
    """Before the old container goes: the turns using it finish, then its residents retire."""
    with anyio.fail_after(manager.config.replace_wait_s):
        await manager.uses.wait_unused(info.id)
    await before_replace(info.id)


async def clear_leftover(manager: ChatContainers, rec: SandboxRecord, volume: str | None) -> None:
    """A container holding the chat's name that the record does not name: left by a
    replacement interrupted after its create. Ours (identity labels; the chat's volume or
    none) → removed; anything else is a stranger the store never recorded."""
    name = container_name(rec.user_id, rec.chat_id)
    try:
        other = await manager.engine.inspect(name)
    except NotFound:
        return
    if other.id == rec.container_id:
        return
    want = manager.identity_labels(rec.user_id, rec.chat_id, rec.data_root_id)
    ours = all(other.labels.get(k) == v for k, v in want.items())
    if not ours or mounted_home(other.attrs)[1] not in (volume, None):
        raise SandboxLost(LostReason.SANDBOX_UNRECORDED, f"{name} exists without a record")
    await manager.engine.remove(other.id)
    log.info("sandbox.leftover_removed", container=name, id=other.id[:12])


async def replace(manager: ChatContainers, rec: SandboxRecord, current: ImageInfo, old: ContainerInfo | None,
                  why: Replaced, before_replace: BeforeReplace) -> Replacement:
    """A container from the configured image on the chat's volume, in place of ``old``
    (None: the recorded container is gone)."""
    assert rec.volume_name is not None and rec.volume_id is not None
    if old is not None:
        await retire_old(manager, old, before_replace)
        await manager.engine.remove(old.id)
    else:
        await before_replace(rec.container_id)  # their processes went with it: forget them
    await clear_leftover(manager, rec, rec.volume_name)
    info = await manager.disk.create(manager.spec(rec.user_id, rec.chat_id, rec.data_root_id, current,
                                                    rec.volume_name))
    try:
        await check_marker(manager.engine, rec, info.id)  # before it ever starts
    except SandboxLost:
        await manager.engine.remove(info.id)
        raise
    return await start_replacement(manager, rec, info, current, why, old.image_id if old else rec.image_id)


async def start_replacement(manager: ChatContainers, rec: SandboxRecord, info: ContainerInfo, current: ImageInfo,
                            why: Replaced, replaced_image_id: str) -> Replacement:
    """Record the new container (the store never names a container that does not exist), start it."""
    rec = rec.model_copy(update={"container_id": info.id, "container_name": info.name.lstrip("/"),
                                 "image_id": current.id, "state": SandboxState.RUNNING, "last_used_at": now()})
    await manager.store.put_sandbox(rec)
    t = time.time()
    await manager.engine.start(info.id)
    info = await manager.engine.inspect(info.id)
    manager.saw_marker(info)
    await manager.gate_ready(info, t)
    log.info(f"sandbox.{why.value}", container=rec.container_name, volume=rec.volume_name,
             image=current.id[:19], replaced_image=replaced_image_id[:19])
    return Replacement(record=rec, container=info, why=why, replaced_image_id=replaced_image_id)
