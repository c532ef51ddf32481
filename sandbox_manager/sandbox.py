"""A resolved sandbox: what :meth:`SandboxManager.resolve <sandbox_manager.sandboxes.
SandboxManager.resolve>` hands a turn — the record, the checked container and image, and what
the call did to get it (created, started, replaced)."""

from __future__ import annotations

from dataclasses import dataclass

from sandbox_manager.engine import ContainerInfo, ImageInfo
from sandbox_manager.identity import Replaced
from state.records import SandboxRecord


@dataclass(frozen=True)
class Sandbox:
    record: SandboxRecord
    container: ContainerInfo
    image: ImageInfo
    created: bool = False  # this call created it
    started: bool = False  # this call started it (it was stopped)
    replaced: Replaced | None = None  # this call replaced the container (on the same volume)
    replaced_image_id: str | None = None  # the image of the container it replaced
    # checked from facts the engine's event stream kept, not against the engine (a resident's
    # turn): an event that had not reached the daemon yet may have made them stale
    from_events: bool = False

    @property
    def container_id(self) -> str:
        return self.container.id

    @property
    def helper_version(self) -> str | None:
        return self.image.labels.get("http-agent-live-bridge")

    @property
    def init_pid(self) -> int | None:
        """The container's init as a host pid (the engine's ``State.Pid``), None when not known."""
        return self.container.init_pid

    @property
    def volume(self) -> str | None:
        return self.record.volume_name
