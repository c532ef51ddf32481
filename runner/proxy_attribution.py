"""Who is behind each model socket, and which turn each member is running (SPEC 12).

The proxy knows a request's chat from the socket that accepted it and its member from the
``/m/<member key>`` prefix; this registry turns those keys into the ids the wire ledger stores
(user, chat, member) and the running job a record belongs to (``turn_of``). It lives beside
the :class:`proxy.ProxyHost` — in the proxy service's process, so a member's running turn
stays known while its daemon restarts: a request the CLI sends then still names the turn the
next daemon finishes.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import UTC, datetime

from proxy import DigestEntry, WireRecord
from proxy.stored_digest import KEYFRAME_DEPTH, as_difference
from state.contract import StoreContract
from state.wire_ledger import WireRecordRow


@dataclass(frozen=True)
class ChatIds:
    user_id: str
    chat_id: str


class Attribution:
    def __init__(self) -> None:
        self.chats: dict[str, ChatIds] = {}  # chat_key -> ids, while its socket is open
        self.members: dict[tuple[str, str], str] = {}  # (chat_key, member_key) -> member_id
        self.turns: dict[tuple[str, str], str] = {}  # (chat_key, member_key) -> running job id

    def open_chat(self, chat_key: str, user_id: str, chat_id: str) -> None:
        self.chats[chat_key] = ChatIds(user_id, chat_id)

    def close_chat(self, chat_key: str) -> None:
        """The chat's socket is closed: its members and turns go with it."""
        self.chats.pop(chat_key, None)
        for table in (self.members, self.turns):
            for key in [k for k in table if k[0] == chat_key]:
                del table[key]

    def member(self, chat_key: str, member_key: str, member_id: str) -> None:
        self.members[(chat_key, member_key)] = member_id

    def begin(self, chat_key: str, member_key: str, member_id: str, job_id: str) -> None:
        self.members[(chat_key, member_key)] = member_id
        self.turns[(chat_key, member_key)] = job_id

    def end(self, chat_key: str, member_key: str, job_id: str) -> None:
        """The member's turn ``job_id`` is over (a later turn of the member is left alone)."""
        if self.turns.get((chat_key, member_key)) == job_id:
            del self.turns[(chat_key, member_key)]

    def keep_turns(self, job_ids: Iterable[str]) -> list[str]:
        """Forget every running turn but ``job_ids`` (after a restart: the turns a dead daemon
        left that nobody finishes); returns the forgotten job ids."""
        keep = set(job_ids)
        gone = [k for k, job in self.turns.items() if job not in keep]
        forgotten = [self.turns.pop(k) for k in gone]
        return forgotten

    def turn_of(self, chat_key: str, member_key: str) -> str | None:
        return self.turns.get((chat_key, member_key))


@dataclass(frozen=True)
class _Stored:
    """A member's last conversational record in the ledger, the parent of its next one."""

    record_id: str
    digest: list[DigestEntry]  # whole
    depth: int  # records since the chain's last whole one


def _captured(record: WireRecord, shared: int) -> str | None:
    """The record's texts as stored (capture on): the request's after its first ``shared``,
    which its parent's capture holds (runner.captured_texts follows the chain), and the reply's."""
    if record.capture is None and record.reply_capture is None:
        return None
    return json.dumps({"request": [m.model_dump() for m in (record.capture or [])[shared:]],
                       "reply": [m.model_dump() for m in record.reply_capture or []]})


class LedgerSink:
    """:class:`proxy.WireSink` into the store: digests in ``record_json``, texts only with capture.

    A member's conversational request is stored as its difference from the member's previous
    one (``proxy.stored_digest``), which this sink remembers once the store has it: a record
    whose write failed is never a parent. A proxy that restarted remembers nothing and stores
    the next record whole. Its captured texts, with capture on, are its difference's too: a
    long chat's capture grew with the square of its turns as its digests did."""

    def __init__(self, store: StoreContract, attribution: Attribution) -> None:
        self.store, self.attribution = store, attribution
        self._last: dict[tuple[str, str], _Stored] = {}  # (chat_key, member_key) -> its last record

    def forget_chat(self, chat_key: str) -> None:
        for key in [k for k in self._last if k[0] == chat_key]:
            del self._last[key]

    async def put(self, record: WireRecord) -> None:
        chat = self.attribution.chats.get(record.chat_key)
        if chat is None:
            return  # closed meanwhile; nothing to attribute it to
        member = (record.chat_key, record.member_key or "")
        member_id = self.attribution.members.get(member)
        record_id = uuid.uuid4().hex
        chained = record.conversational and record.digest is not None and record.member_key is not None
        stored, depth = record, 0
        parent = self._last.get(member) if chained else None
        if parent is not None and parent.depth + 1 < KEYFRAME_DEPTH:
            difference = as_difference(record, parent.record_id, parent.digest)
            if difference is not None:
                stored, depth = difference, parent.depth + 1
        row = WireRecordRow(
            record_id=record_id, user_id=chat.user_id, chat_id=chat.chat_id, member_id=member_id,
            job_id=record.job_id, ordinal=f"{record.started_at.isoformat()}|{record.seq:012d}",
            record_json=stored.model_dump_json(exclude={"capture", "reply_capture"}),
            capture_json=_captured(record, stored.digest_shared or 0),
            created_at=datetime.now(UTC).isoformat(), digest_parent=stored.digest_parent)
        if not await self.store.put_wire_record(row):  # its parent is gone (the chat was deleted): whole
            depth = 0
            await self.store.put_wire_record(dataclasses.replace(
                row, record_json=record.model_dump_json(exclude={"capture", "reply_capture"}),
                capture_json=_captured(record, 0), digest_parent=None))
        if chained and record.chat_key in self.attribution.chats:
            self._last[member] = _Stored(record_id, record.digest or [], depth)  # never changed: not copied
