"""A chat's status (SPEC 10 ``GET /v1/users/{user_id}/chats/{chat_id}``): its sandbox (state,
reasons, expiry, container, image, volume), its members (locator, turns, resident or not,
fork origin) and its last receipts."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from runner.residents import ResidentPool
from runner.sweeps import Sweeps
from state.contract import StoreContract
from state.receipts import Receipt


async def chat_status(store: StoreContract, pool: ResidentPool, sweeps: Sweeps, user_id: str,
                      chat_id: str) -> dict[str, Any] | None:
    """None: the store knows neither a sandbox nor a member of the chat."""
    sb = await store.get_sandbox(user_id, chat_id)
    members = await store.list_members(user_id, chat_id)
    if sb is None and not members:
        return None
    receipts = [Receipt.model_validate_json(r).model_dump(mode="json")
                for r in await store.recent_receipts(user_id, chat_id)]
    return {
        "user_id": user_id, "chat_id": chat_id,
        "sandbox": None if sb is None else {
            "state": sb.state.value, "lost_reason": sb.lost_reason, "stop_reason": sb.stop_reason,
            "expires_at": _iso(sweeps.expires_at(sb)), "container_id": sb.container_id,
            "container_name": sb.container_name, "image_id": sb.image_id, "volume": sb.volume_name,
            "last_used_at": sb.last_used_at.isoformat(),
        },
        "members": [{
            "member_id": m.member_id, "runtime": m.runtime,
            "locator": None if m.locator is None else m.locator.model_dump(),
            "settled_turns": m.settled_turns, "last_status": m.last_status, "last_outcome": m.last_outcome,
            "resident": pool.is_resident((user_id, chat_id, m.member_id)),
            "forked_from": m.forked_from, "lost_reason": m.lost_reason,
        } for m in members],
        "last_receipts": receipts,
    }


def _iso(ts: datetime | None) -> str | None:
    return None if ts is None else ts.isoformat()
