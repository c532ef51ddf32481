"""The host view of the inspector (SPEC section 17): residents (and their memory against
the budget), the admission queue, the retained sandboxes and the attestation summary.

The memory budget and the queue come from the capacity work (SPEC section 13): a resident's
memory is its last reading (what the budget counts: its tree's peak RSS), null until read.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from runner.supervisor import Supervisor

MAX_SANDBOXES = 500


class ResidentView(BaseModel):
    user_id: str
    chat_id: str
    member_id: str
    runtime: str
    container_id: str
    alive: bool
    in_turn: bool
    idle_s: float
    memory_bytes: int | None = Field(default=None, description="null: not measured on this host")


class BudgetView(BaseModel):
    limit_bytes: int
    used_bytes: int


class QueueView(BaseModel):
    depth: int
    entries: list[dict[str, Any]] = Field(default_factory=list)


class SandboxView(BaseModel):
    user_id: str
    chat_id: str
    state: str
    lost_reason: str | None
    container_id: str
    container_name: str
    image_id: str
    volume: str | None = Field(description="the chat's state volume (SPEC 15); null: made before state volumes")
    host_id: str
    last_used_at: datetime
    residents: int


class AttestationSummary(BaseModel):
    source_sha: str | None
    source_dirty: bool | None
    image_ref: str | None
    image_id: str | None
    helper_version: str | None
    required_helper: str | None
    engine_version: str | None
    probe_ok: bool | None
    probe_age_s: float | None
    heartbeat_age_s: float | None
    heartbeat_stale: bool | None
    ready: bool | None
    reasons: list[str]


class HostView(BaseModel):
    host_id: str
    now: datetime
    residents: list[ResidentView]
    budget: BudgetView | None = Field(description="the resident memory budget and what it counts now")
    queue: QueueView | None = Field(description="jobs waiting for admission, in the order they will be served")
    sandboxes: list[SandboxView] = Field(description=f"the {MAX_SANDBOXES} most recently used")
    sandboxes_total: int
    attestation: AttestationSummary | None


def summarize_attestation(doc: dict[str, Any] | None) -> AttestationSummary | None:
    if doc is None:
        return None
    src, img, eng = doc.get("source") or {}, doc.get("image") or {}, doc.get("engine") or {}
    probe, hb, ready = doc.get("reverse_probe") or {}, doc.get("heartbeat") or {}, doc.get("readiness") or {}
    req = doc.get("required_helper") or {}
    return AttestationSummary(
        source_sha=src.get("sha"), source_dirty=src.get("dirty"), image_ref=img.get("ref"), image_id=img.get("id"),
        helper_version=img.get("helper_version"),
        required_helper=f"{req['name']}={req['version']}" if req.get("name") else None,
        engine_version=eng.get("version"), probe_ok=probe.get("ok"), probe_age_s=probe.get("age_s"),
        heartbeat_age_s=hb.get("age_s"), heartbeat_stale=hb.get("stale"), ready=ready.get("ready"),
        reasons=list(ready.get("reasons") or []))


async def host_view(sup: Supervisor, attestation: dict[str, Any] | None) -> HostView:
    now = time.monotonic()
    residents = []
    for key in sup.pool.keys():
        r = sup.pool.get(key)
        if r is None:
            continue
        residents.append(ResidentView(user_id=key[0], chat_id=key[1], member_id=key[2], runtime=r.runtime,
                                      container_id=r.container_id, alive=r.alive, in_turn=sup.in_turn(key),
                                      idle_s=round(max(0.0, now - r.last_used), 1),
                                      memory_bytes=r.measured_bytes))
    per_chat: dict[tuple[str, str], int] = {}
    for res in residents:
        per_chat[(res.user_id, res.chat_id)] = per_chat.get((res.user_id, res.chat_id), 0) + 1
    records = sorted(await sup.store.list_sandboxes(), key=lambda r: r.last_used_at, reverse=True)
    sandboxes = [SandboxView(user_id=r.user_id, chat_id=r.chat_id, state=r.state.value, lost_reason=r.lost_reason,
                             container_id=r.container_id, container_name=r.container_name, image_id=r.image_id,
                             volume=r.volume_name, host_id=r.host_id, last_used_at=r.last_used_at,
                             residents=per_chat.get((r.user_id, r.chat_id), 0))
                 for r in records[:MAX_SANDBOXES]]
    mem, adm = sup.memory, sup.capacity.admission
    budget = BudgetView(limit_bytes=mem.policy.budget, used_bytes=mem.committed())
    queue = QueueView(depth=adm.depth, entries=[
        {"user_id": t.user_id, "chat_id": t.chat[1], "job_id": t.job_id, "position": pos, "waited_ms": t.waited_ms()}
        for t, pos in sorted(adm.queue.positions().items(), key=lambda kv: kv[1])])
    return HostView(host_id=sup.manager.config.host_id, now=datetime.now(UTC), residents=residents,
                    budget=budget, queue=queue, sandboxes=sandboxes, sandboxes_total=len(records),
                    attestation=summarize_attestation(attestation))
