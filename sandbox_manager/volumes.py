"""State volumes (SPEC 15): one named volume per chat, mounted at the agent's home.

The volume holds the workspace and every member's native CLI state, so a container can be
replaced (lost, or made from an older image) without losing a conversation. Its identity is
checked like the container's, three ways, from cheapest to dearest:

* labels — the chat's identity labels plus a random volume id, read by one volume inspect
  on every turn (a missing volume is ``volume_missing``, other labels ``volume_mismatch``);
* the mount — the container mounts exactly the recorded volume at the agent's home (read
  from the container inspect the turn already makes);
* the marker — a root-owned file in the volume naming the volume id and the chat identity,
  written at creation and read whenever a container is created or started on the volume, or
  first seen running by this daemon: through the archive API (no exec), or, for a container
  started, from its model gate's listening line (the container's command reads it first). Labels can be
  copied onto a volume made elsewhere; the marker travels only with the volume's content,
  so another chat's content under this chat's name and labels is caught too.

A running container's mounts cannot change and the engine refuses to remove a volume in use,
so one marker read per container start is enough; a LIVE turn adds no exec.
"""

from __future__ import annotations

import json
from typing import Any

from sandbox_manager.engine import AGENT_HOME, ContainerInfo, Engine, NotFound, VolumeInfo
from sandbox_manager.identity import LostReason, SandboxLost, digest
from state.records import SandboxRecord

LABEL_VOLUME_ID = "org.cloud-agent.volume-id"
MARKER_PATH = f"{AGENT_HOME}/.cloud-agent-volume"


def volume_name(container_name: str) -> str:
    """The chat's volume: named after its (hash-derived) container name."""
    return f"{container_name}-home"


def volume_labels(identity: dict[str, str], volume_id: str) -> dict[str, str]:
    return {**identity, LABEL_VOLUME_ID: volume_id}


def label_problems(info: VolumeInfo, identity: dict[str, str], volume_id: str) -> list[str]:
    """Label names that differ from the chat's (empty: the volume's labels are the recorded ones)."""
    want = volume_labels(identity, volume_id)
    return sorted(k for k, v in want.items() if info.labels.get(k) != v)


def marker_bytes(identity_digest: str, volume_id: str) -> bytes:
    return json.dumps({"identity": identity_digest, "volume_id": volume_id}, sort_keys=True).encode() + b"\n"


def marker_problem(raw: bytes | None, identity_digest: str, volume_id: str) -> str | None:
    """Why a marker is not this volume's (None: it is)."""
    if raw is None:
        return f"no identity marker at {MARKER_PATH}"
    try:
        got: Any = json.loads(raw)
    except ValueError:
        return f"unreadable identity marker at {MARKER_PATH}"
    if not isinstance(got, dict):
        return f"unreadable identity marker at {MARKER_PATH}"
    if got.get("identity") != identity_digest:
        return "the identity marker names another chat"
    if got.get("volume_id") != volume_id:
        return f"the identity marker names volume id {str(got.get('volume_id'))[:12]}, not {volume_id[:12]}"
    return None


def mounted_home(attrs: dict[str, Any]) -> tuple[str | None, str | None]:
    """(type, name) of what a container mounts at the agent's home; (None, None) if nothing."""
    for m in attrs.get("Mounts") or []:
        if m.get("Destination") == AGENT_HOME:
            return m.get("Type"), m.get("Name")
    return None, None


# -- the checks (each raises SandboxLost with the reason) ---------------------------------------


def judge_volume(rec: SandboxRecord, identity: dict[str, str], vol: VolumeInfo | None) -> None:
    """The recorded volume (``vol``: its inspect, None when the engine has none of that name)
    exists and carries the chat's identity labels and its volume id."""
    assert rec.volume_name is not None and rec.volume_id is not None
    if vol is None:
        raise SandboxLost(LostReason.VOLUME_MISSING, f"volume {rec.volume_name} is gone")
    bad = label_problems(vol, identity, rec.volume_id)
    if bad:
        raise SandboxLost(LostReason.VOLUME_MISMATCH, f"volume {rec.volume_name}: labels differ: " + ", ".join(bad))


def check_mount(rec: SandboxRecord, info: ContainerInfo) -> None:
    """The container mounts exactly the recorded volume at the agent's home."""
    kind, name = mounted_home(info.attrs)
    if (kind, name) != ("volume", rec.volume_name):
        raise SandboxLost(LostReason.VOLUME_MISMATCH,
                          f"the container mounts {name or kind or 'nothing'} at the agent's home, "
                          f"not the chat's volume {rec.volume_name}")


async def check_marker(engine: Engine, rec: SandboxRecord, container_id: str) -> None:
    """The volume's identity marker, read through a container on it (created, stopped or running)."""
    try:
        raw: bytes | None = await engine.read_file(container_id, MARKER_PATH)
    except NotFound:
        raw = None
    judge_marker(rec, raw)


def judge_marker(rec: SandboxRecord, raw: bytes | None) -> None:
    """SandboxLost unless ``raw`` (the marker's content, None: absent) is the recorded volume's."""
    assert rec.volume_id is not None
    problem = marker_problem(raw, digest("sandbox", rec.user_id, rec.chat_id), rec.volume_id)
    if problem:
        raise SandboxLost(LostReason.VOLUME_MISMATCH, f"volume {rec.volume_name}: {problem}")
