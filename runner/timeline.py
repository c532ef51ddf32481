"""A chat's turns in start order with their receipts, paged (SPEC section 17).

Order: the job's start (its claim by the job fence), then its job id — a total order that
no later job changes, so the opaque cursor (the last row's sort key) pages stably while
the chat goes on. Running jobs are listed too, without a receipt.
"""

from __future__ import annotations

import base64
import binascii
import json
from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from state.receipts import Receipt
from state.records import JobRecord, JobState
from state.store import Store

DEFAULT_PAGE = 50
MAX_PAGE = 200

SortKey = tuple[str, str]  # (created_at as stored, job_id)


class Turn(BaseModel):
    index: int = Field(description="1-based position of the job in the chat's timeline")
    job_id: str
    member_id: str
    state: Literal["running", "done"]
    started_at: datetime
    receipt: Receipt | None = Field(description="null while the job runs")


class TurnPage(BaseModel):
    user_id: str
    chat_id: str
    total: int = Field(description="the chat's jobs, all pages")
    turns: list[Turn]
    next_cursor: str | None = Field(description="pass as ?cursor= for the next page; null on the last page")


class BadCursor(ValueError):
    pass


def sort_key(rec: JobRecord) -> SortKey:
    return rec.created_at.isoformat(), rec.job_id


def encode_cursor(key: SortKey) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode().rstrip("=")


def decode_cursor(cursor: str) -> SortKey:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        value = json.loads(raw)
    except (binascii.Error, ValueError) as exc:
        raise BadCursor("not a cursor this API issued") from exc
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, str) for v in value)):
        raise BadCursor("not a cursor this API issued")
    try:
        datetime.fromisoformat(value[0])
    except ValueError as exc:
        raise BadCursor("not a cursor this API issued") from exc
    return value[0], value[1]


def to_turn(rec: JobRecord, index: int) -> Turn:
    receipt = Receipt.model_validate_json(rec.receipt_json) if rec.receipt_json else None
    return Turn(index=index, job_id=rec.job_id, member_id=rec.member_id,
                state="done" if rec.state == JobState.DONE else "running", started_at=rec.created_at,
                receipt=receipt)


async def chat_exists(store: Store, user_id: str, chat_id: str) -> bool:
    """A chat is known when it has a sandbox, a member or a job (a first job refused before
    any member existed still has a receipt); scoped by user like every lookup."""
    if await store.get_sandbox(user_id, chat_id) is not None or await store.list_members(user_id, chat_id):
        return True
    return await store.count_chat_jobs(user_id, chat_id) > 0


async def turn_page(store: Store, user_id: str, chat_id: str, *, cursor: str | None = None,
                    limit: int = DEFAULT_PAGE) -> TurnPage:
    after = decode_cursor(cursor) if cursor else None
    rows = await store.chat_jobs(user_id, chat_id, after=after, limit=limit + 1)
    more = len(rows) > limit
    rows = rows[:limit]
    first = 1 + (await store.count_chat_jobs(user_id, chat_id, before=sort_key(rows[0])) if rows else 0)
    total = await store.count_chat_jobs(user_id, chat_id)
    return TurnPage(user_id=user_id, chat_id=chat_id, total=total,
                    turns=[to_turn(r, first + i) for i, r in enumerate(rows)],
                    next_cursor=encode_cursor(sort_key(rows[-1])) if more else None)


async def turn_at(store: Store, user_id: str, chat_id: str, index: int | None) -> Turn | None:
    """The chat's turn ``index`` (1-based); the latest without it."""
    if index is None:
        rows = await store.chat_jobs(user_id, chat_id, limit=1, newest_first=True)
        return to_turn(rows[0], await store.count_chat_jobs(user_id, chat_id)) if rows else None
    rows = await store.chat_jobs(user_id, chat_id, offset=index - 1, limit=1)
    return to_turn(rows[0], index) if rows else None


async def member_history(store: Store, turn: Turn, user_id: str, chat_id: str, limit: int = 20) -> list[Receipt]:
    """The receipts of the member's turns up to and including ``turn`` (the last ``limit``),
    oldest first: the locator chain."""
    until = (turn.started_at.isoformat(), turn.job_id)
    rows = await store.chat_jobs(user_id, chat_id, member_id=turn.member_id, until=until, limit=limit,
                                 newest_first=True)
    return [Receipt.model_validate_json(r.receipt_json) for r in reversed(rows) if r.receipt_json]
