"""Deleting a chat on this host (SPEC 10 ``DELETE /v1/users/{user_id}/chats/{chat_id}``).

In order: the chat's turns that are running or waiting for their member are cancelled (their
receipts say ``not_settled``, reason ``chat_deleted``); with every member lock of the chat held,
its residents are retired, its model socket closed, its container, state volume and socket
directory removed (``SandboxManager.remove``), and its records deleted with only tombstone
receipts kept (``state.chat_deletion``). The whole of it runs shielded: a client that goes away
never leaves half a chat.

One deletion of a chat at a time; a job that arrives while its chat is being deleted waits for
the deletion (:meth:`ChatDeletions.wait_clear`) and then runs on the new chat (``NEW``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

import anyio
import structlog

from state.jobs import CHAT_DELETED, ChatDeleted

if TYPE_CHECKING:
    from runner.supervisor import Supervisor

log = structlog.get_logger("chat_deletion")

Chat = tuple[str, str]


class ChatDeletions:
    """The chats being deleted on this host: an event each, set when its deletion is done."""

    def __init__(self) -> None:
        self._running: dict[Chat, anyio.Event] = {}

    async def wait_clear(self, chat: Chat) -> None:
        while (deleting := self._running.get(chat)) is not None:
            await deleting.wait()

    @asynccontextmanager
    async def exclusive(self, chat: Chat) -> AsyncIterator[None]:
        await self.wait_clear(chat)  # a second deletion runs after the first and finds it gone
        done = self._running[chat] = anyio.Event()
        try:
            yield
        finally:
            self._running.pop(chat, None)
            done.set()


async def delete_chat(sup: Supervisor, user_id: str, chat_id: str) -> ChatDeleted:
    chat = (user_id, chat_id)
    async with sup.deletions.exclusive(chat):
        with anyio.CancelScope(shield=True):
            doomed = sup.jobs_of_chat(chat)
            for entry in doomed:
                sup.runner.cancel_reasons[(user_id, entry.job.job_id)] = CHAT_DELETED
                entry.scope.cancel()
            for entry in doomed:
                await entry.done.wait()
                sup.runner.cancel_reasons.pop((user_id, entry.job.job_id), None)
            async with sup.locks.hold_all(sup.locks.chat_keys(user_id, chat_id)):
                retired = await sup.pool.retire_where(lambda r: r.key[:2] == chat, "chat deleted")
                await sup.model_path.close(user_id, chat_id)
                sup.model_path.forget_chat(user_id, chat_id)
                removed = await sup.manager.remove(user_id, chat_id)
                rows = await sup.store.delete_chat(user_id, chat_id)
    log.info("chat.deleted", cancelled=len(doomed), retired=retired, container=removed.container,
             volume=removed.volume, tombstoned=rows.tombstoned)
    return ChatDeleted(user_id=user_id, chat_id=chat_id, cancelled_jobs=len(doomed), retired_residents=retired,
                       container_removed=removed.container, volume_removed=removed.volume,
                       records_removed=rows.removed, tombstoned_receipts=rows.tombstoned)
