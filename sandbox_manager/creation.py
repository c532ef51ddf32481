"""A new chat's sandbox (SPEC 7, 15): its volume, its container, its marker and its record.

A turn of a chat with no record gets one: the checked image in this engine's data root, on
a volume made for it (an existing one of that name is never adopted), its identity marker
written into the volume's content before anything runs, its record committed while the
engine starts it. What a check of the next turn would establish holds by construction, so the
facts are kept at once (sandbox_manager.integrity). Like a replacement
(sandbox_manager.replacement) it takes a :class:`ChatContainers`, never the manager.
"""

from __future__ import annotations

import anyio
import structlog

from sandbox_manager.chat_containers import ChatContainers
from sandbox_manager.engine import Conflict
from sandbox_manager.identity import LostReason, SandboxLost, container_name
from sandbox_manager.integrity import Facts
from sandbox_manager.reads_at_once import read_at_once
from sandbox_manager.sandbox import Sandbox
from state.records import SandboxRecord, SandboxState
from state.store import now

log = structlog.get_logger("sandbox")


async def create_sandbox(manager: ChatContainers, user_id: str, chat_id: str) -> Sandbox:
    """A new chat's sandbox on a new volume, recorded, started and its facts kept (the caller
    holds the chat's lock and tells its watchers)."""
    # both kept from the last new sandbox while the engine's events say nothing changed them
    image = await manager.image_for_new_sandbox(manager.config.image)
    root = await manager.data_root_id()
    name = container_name(user_id, chat_id)
    vol = await manager.new_volume(user_id, chat_id, root)  # an existing volume: SANDBOX_UNRECORDED
    try:
        info = await manager.disk.create(manager.spec(user_id, chat_id, root, image, vol.name))
    except Conflict:
        # A container with this identity but no record: the store lost track of it. Asked
        # by the create itself (its name is taken), not by an inspect before every new
        # sandbox (issue 16); the volume just made for it goes again, nothing ran on it.
        with anyio.CancelScope(shield=True):
            await manager.engine.remove_volume(vol.name)
        raise SandboxLost(LostReason.SANDBOX_UNRECORDED, f"{name} exists without a record") from None
    # The image's home was copied into the volume at the create, and nothing has run in
    # the container yet: the marker goes straight into the volume's content (not the
    # archive API's ~57 ms re-exec of the engine, which the start then waited behind)
    marked = await manager.write_marker_on_host(vol, user_id, chat_id)
    ts = now()
    rec = SandboxRecord(user_id=user_id, chat_id=chat_id, container_id=info.id, container_name=name,
                        image_id=image.id, data_root_id=root, host_id=manager.config.host_id,
                        state=SandboxState.RUNNING, created_at=ts, last_used_at=ts,
                        volume_name=vol.name, volume_id=vol.volume_id)
    # Shielded: a container that may have started is recorded whatever interrupts its creator
    # (unrecorded, its chat would be LOST as sandbox_unrecorded).
    with anyio.CancelScope(shield=True):
        if marked:
            # Marked, the container is the chat's from its create on: its record is committed
            # while the engine starts it (issue 16). A failed start leaves the record of a
            # stopped container, which the next resolve starts and checks like any other.
            await start_while_recording(manager, info.id, rec)
        else:
            await manager.engine.start(info.id)
        # Taken before the inspect: an event of the container after it drops what is put below.
        token = manager.integrity.token(info.id)
        # Not waited for here: the model gate's listening line (6-9 ms after the start). Every
        # CLI's launcher waits for the gate to listen before the CLI starts
        # (ChatContainers.model_endpoint), and nothing reads the gate's report of the marker
        # just written. A restart still waits for it (SandboxManager._start_checked: the
        # marker's verdict).
        started = await manager.engine.inspect(info.id)
        manager.saw_marker(started)
        if not marked:
            await manager.write_marker(started.id, user_id, chat_id, vol.volume_id)
            await manager.store.put_sandbox(rec)  # only once the marker is there
    log.info("sandbox.created", container=name, volume=vol.name, image=image.id[:19], network="none")
    # What a check of the next turn would establish holds by construction (this container,
    # of the checked image, in this data root, on its new volume, its marker written): the
    # chat's second turn is served from these facts, not from four engine calls (issue 16).
    manager.integrity.put(token, Facts(started, image, root, vol.name))
    return Sandbox(record=rec, container=started, image=image, created=True)


async def start_while_recording(manager: ChatContainers, container_id: str, rec: SandboxRecord) -> None:
    """The engine's start and the record's commit side by side; either failure is raised as
    itself (the start's first), after both ended."""
    started, recorded = await read_at_once(lambda: manager.engine.start(container_id),
                                           lambda: manager.store.put_sandbox(rec))
    started.get()
    recorded.get()
