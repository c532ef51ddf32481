"""Sandboxes made the way the product made them before state volumes (issue 15's migration).

Before state volumes a sandbox was one container, its workspace and native CLI state in the
container's writable layer, recorded without a volume. The product's own container spec
(``SandboxManager.spec``) with no volume is exactly that shape (same image, labels, name,
hardening and, where sealed, the model socket), so both helpers create the old sandbox
through it:

* :func:`legacy_sandbox` — a new chat's old-style sandbox with some files in its home;
* :func:`make_legacy` — turn a chat that ran real CLI turns on its volume into the old
  shape: its whole ``/home/agent`` (native state included) is copied into an old-style
  container's writable layer, its volume container and volume removed, and the record
  rewritten without a volume. What the daemon then finds is what an upgraded daemon finds
  on a host full of pre-volume sandboxes.
"""

from __future__ import annotations

from sandbox_manager.engine import AGENT_HOME, FileEntry, NotFound
from sandbox_manager.identity import container_name
from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.volumes import volume_name
from state.contract import now
from state.records import SandboxRecord, SandboxState


async def legacy_sandbox(manager: SandboxManager, user_id: str, chat_id: str,
                         files: list[FileEntry] | None = None, *, running: bool = True) -> SandboxRecord:
    image = await manager.checked_image(manager.config.image)
    root = await manager.data_root_id()
    info = await manager.engine.create(manager.spec(user_id, chat_id, root, image, None))
    if files:
        await manager.engine.put_files(info.id, files, [])
    if running:
        await manager.engine.start(info.id)
    ts = now()
    rec = SandboxRecord(user_id=user_id, chat_id=chat_id, container_id=info.id,
                        container_name=container_name(user_id, chat_id), image_id=image.id, data_root_id=root,
                        host_id=manager.config.host_id,
                        state=SandboxState.RUNNING if running else SandboxState.STOPPED,
                        created_at=ts, last_used_at=ts)
    await manager.store.put_sandbox(rec)
    return rec


async def make_legacy(manager: SandboxManager, user_id: str, chat_id: str) -> SandboxRecord:
    """The chat's sandbox, moved back into the pre-volume shape (call with no turn running and
    its residents retired)."""
    rec = await manager.store.get_sandbox(user_id, chat_id)
    assert rec is not None and rec.volume_name is not None, "a chat with a volume sandbox"
    engine = manager.engine
    await engine.stop(rec.container_id)
    await engine.rename(rec.container_id, f"{rec.container_name}-volume")
    legacy = await engine.create(manager.spec(user_id, chat_id, rec.data_root_id,
                                              await engine.image(rec.image_id), None))
    await engine.copy_tree(rec.container_id, AGENT_HOME, legacy.id)  # into the writable layer
    await engine.remove(rec.container_id)
    try:
        await engine.remove_volume(rec.volume_name)
    except NotFound:
        pass
    assert volume_name(rec.container_name) == rec.volume_name
    await engine.start(legacy.id)
    old = rec.model_copy(update={"container_id": legacy.id, "volume_name": None, "volume_id": None,
                                 "state": SandboxState.RUNNING})
    await manager.store.put_sandbox(old)
    return old
