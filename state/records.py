"""Durable records: retained sandboxes, members and their native locators."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import BaseModel, ConfigDict


class SandboxState(StrEnum):
    RUNNING = "running"
    STOPPED = "stopped"
    LOST = "lost"


class SandboxRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    chat_id: str
    container_id: str
    container_name: str
    image_id: str
    data_root_id: str
    host_id: str
    state: SandboxState
    lost_reason: str | None = None
    stop_reason: str | None = None  # set: kept stopped, turns refused with this reason
    created_at: datetime
    last_used_at: datetime
    # The chat's state volume (SPEC 15): its name and the random id in its label and marker
    # file. None: a sandbox made before state volumes (native state in the writable layer),
    # migrated to a volume at its next turn.
    volume_name: str | None = None
    volume_id: str | None = None


class SavedLocator(BaseModel):
    """The durable form of a member's native locator (``drivers.models.Locator`` in the runner)."""

    model_config = ConfigDict(frozen=True)

    id: str
    path: str | None = None


class PendingFork(BaseModel):
    """A fork the CLI itself makes when the new member's first turn starts (Claude:
    ``--resume PARENT --fork-session``): nothing native exists until then."""

    model_config = ConfigDict(frozen=True)

    parent: SavedLocator
    at_turn: int | None = None


class MemberRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    user_id: str
    chat_id: str
    member_id: str
    runtime: str
    locator: SavedLocator | None = None
    settled_turns: int = 0
    last_status: str | None = None  # NEW / LIVE / RESTORED / LOST of the last turn
    last_outcome: str | None = None
    forked_from: str | None = None  # member_id this one was forked from
    lost_reason: str | None = None  # set once: a LOST member stays LOST
    home_member_id: str  # whose native home (config dirs, session stores) this member uses
    pending_fork: PendingFork | None = None
    created_at: datetime
    updated_at: datetime
    # Where the member's native state was last verified (its last committed verified turn):
    # a later turn on another container is a recreated sandbox, on another image an upgrade.
    last_container_id: str | None = None
    last_image_id: str | None = None
    last_cli_version: str | None = None


class JobState(StrEnum):
    RUNNING = "running"
    DONE = "done"


class JobRecord(BaseModel):
    model_config = ConfigDict(frozen=True)

    job_id: str
    user_id: str
    chat_id: str
    member_id: str
    body_digest: str
    state: JobState
    owner: str  # the daemon instance that claimed it
    receipt_json: str | None = None
    created_at: datetime
    finished_at: datetime | None = None
    host_id: str | None = None  # the host that claimed it (None: before fleets, or unbound)
    host_epoch: int | None = None  # that host's lease epoch at the claim
    deleted_at: datetime | None = None  # its chat was deleted: receipt_json is a tombstone
