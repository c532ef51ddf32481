"""Moving a sandbox made before state volumes onto one (SPEC 15, once per sandbox).

Such a sandbox keeps the workspace and the native CLI state in its container's writable
layer. Its next turn moves them: the old container is stopped (turns on it finished, its
residents retired) and set aside under another name, the chat's volume is created, a new
container from the configured image mounts it, the old ``/home/agent`` is streamed into it
through the archive API (ownership and modes kept), the identity marker is written, the
record names the new container and its volume, and only then is the old container removed.
Each member's next turn then resumes through its CLI's own handshake: that is what
verifies the move (a member whose native state did not arrive is LOST, never NEW).

Every step is safe to repeat: a move interrupted part-way leaves the old container (by its
recorded id) and at most a partial volume and container of ours, which the next attempt
removes and redoes. Where no move is possible — the old container is gone, with the native
state it held — the sandbox is LOST ``migration_impossible``, saying so.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from sandbox_manager.chat_containers import ChatContainers, NewVolume
from sandbox_manager.engine import AGENT_HOME, ContainerInfo, ImageInfo, NotFound
from sandbox_manager.identity import LostReason, Replaced, SandboxLost, container_name
from sandbox_manager.replacement import BeforeReplace, Replacement, clear_leftover, retire_old, start_replacement
from sandbox_manager.volumes import LABEL_VOLUME_ID, volume_name

if TYPE_CHECKING:
    from state.records import SandboxRecord

log = structlog.get_logger("sandbox")

ASIDE_SUFFIX = "-premigration"


async def migrate(manager: ChatContainers, rec: SandboxRecord, current: ImageInfo,
                  before_replace: BeforeReplace) -> Replacement:
    try:
        old = await manager.engine.inspect(rec.container_id)
    except NotFound:
        raise SandboxLost(LostReason.MIGRATION_IMPOSSIBLE,
                          f"container {rec.container_name} is gone: it was made before state volumes and held "
                          "the native state itself, so there is nothing to move to a volume") from None
    manager.check_identity(rec, old)
    await retire_old(manager, old, before_replace)
    if old.running:
        await manager.engine.stop(old.id)
    name = container_name(rec.user_id, rec.chat_id)
    if old.name.lstrip("/") != name + ASIDE_SUFFIX:
        await manager.engine.rename(old.id, name + ASIDE_SUFFIX)
    await clear_leftover(manager, rec, volume_name(name))
    vol = await _fresh_volume(manager, rec)
    info = await manager.disk.create(manager.spec(rec.user_id, rec.chat_id, rec.data_root_id, current, vol.name))
    await manager.engine.copy_tree(old.id, AGENT_HOME, info.id)
    await manager.write_marker(info.id, rec.user_id, rec.chat_id, vol.volume_id)
    moved = rec.model_copy(update={"volume_name": vol.name, "volume_id": vol.volume_id})
    done = await start_replacement(manager, moved, info, current, Replaced.MIGRATED, old.image_id)
    await _remove_old(manager, old)
    return done


async def _fresh_volume(manager: ChatContainers, rec: SandboxRecord) -> NewVolume:
    """The chat's volume, new. One of that name with the chat's identity labels can only be
    a partial copy of an interrupted move (the record names no volume yet): it goes."""
    name = volume_name(container_name(rec.user_id, rec.chat_id))
    try:
        existing = await manager.engine.inspect_volume(name)
    except NotFound:
        existing = None
    if existing is not None:
        want = manager.identity_labels(rec.user_id, rec.chat_id, rec.data_root_id)
        if any(existing.labels.get(k) != v for k, v in want.items()) or LABEL_VOLUME_ID not in existing.labels:
            raise SandboxLost(LostReason.VOLUME_MISMATCH, f"volume {name} exists and is not this chat's")
        await manager.engine.remove_volume(name)
        log.info("sandbox.partial_volume_removed", volume=name)
    return await manager.new_volume(rec.user_id, rec.chat_id, rec.data_root_id)


async def _remove_old(manager: ChatContainers, old: ContainerInfo) -> None:
    try:
        await manager.engine.remove(old.id)
    except NotFound:
        pass
