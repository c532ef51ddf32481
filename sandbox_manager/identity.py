"""A sandbox's identity: its labels, its hash-derived names and the reasons it can be lost."""

from __future__ import annotations

import functools
import hashlib
from enum import StrEnum

LABEL_PREFIX = "org.cloud-agent"
LABEL_SANDBOX = f"{LABEL_PREFIX}.sandbox"
LABEL_IDENTITY = f"{LABEL_PREFIX}.identity"
LABEL_USER = f"{LABEL_PREFIX}.user-digest"
LABEL_CHAT = f"{LABEL_PREFIX}.chat-digest"
LABEL_HOST = f"{LABEL_PREFIX}.host-id"
LABEL_DATA_ROOT = f"{LABEL_PREFIX}.dataroot-id"


class LostReason(StrEnum):
    # (before state volumes a gone container was LOST container_missing: now it is recreated
    # on the chat's volume, and the volume's loss is what loses the native state)
    CONTAINER_REPLACED = "container_replaced"
    LABELS_MISMATCH = "labels_mismatch"
    DATA_ROOT_CHANGED = "data_root_changed"
    SANDBOX_UNRECORDED = "sandbox_unrecorded"
    PREVIOUSLY_LOST = "previously_lost"
    WRONG_HOST = "wrong_host"
    VOLUME_MISSING = "volume_missing"  # the chat's state volume is gone
    VOLUME_MISMATCH = "volume_mismatch"  # a volume is there, but not the recorded one
    # made before state volumes, and its container (which held the native state) is gone
    MIGRATION_IMPOSSIBLE = "migration_impossible"


class SandboxLost(Exception):
    def __init__(self, reason: LostReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class Replaced(StrEnum):
    """Why a resolve put a new container on the chat's volume."""

    RECREATED = "recreated"  # the recorded container was gone
    UPGRADED = "upgraded"  # it ran another image than the configured one
    MIGRATED = "migrated"  # it was made before state volumes (native state copied to a volume)
    RESEALED = "resealed"  # it was made before sealed sandboxes (network, no model socket mount)


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


@functools.lru_cache(maxsize=4096)  # asked several times a turn (the proxy's chat key, the resolve)
def container_name(user_id: str, chat_id: str) -> str:
    # Derived from a hash of the ids: no raw user input ever reaches a container name.
    return f"ca-{digest('sandbox', user_id, chat_id)[:24]}"


@functools.lru_cache(maxsize=4096)
def member_key(member_id: str) -> str:
    return digest("member", member_id)[:16]
