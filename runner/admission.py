"""Admission (SPEC section 13): at most CLOUD_AGENT_MAX_TURNS jobs run, the rest wait in a
queue that is fair between users, and a job still waiting at CLOUD_AGENT_QUEUE_TIMEOUT_S
is answered ``host_busy`` — before anything ran or was committed.

Where it sits: after validation and a read-only look at the job fence (a repeated job id
is answered at once, never queued), before the fence claims the job id and before the
HTTP answer starts. So a job that times out in the queue has no job row (a re-dispatch
later runs normally), the answer can be a real 503 with ``Retry-After``, and a daemon
that dies while jobs wait leaves nothing to recover. The ``queued`` events a job passes
through are kept in its stream and are its first lines once it is admitted; meanwhile
``GET /v1/jobs/{job_id}`` answers 202 with the live position.

A job is admitted when a turn slot is free and its sandbox has room (runner.sandbox_room);
the fair queue's front job waits for both, so nobody overtakes it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
from pydantic import BaseModel, Field

from runner.fair_queue import FairQueue
from runner.sandbox_room import Chat, Placement, SandboxRoom


class QueuedEvent(BaseModel):
    """The job waits for admission; sent when it joins the queue and whenever its place
    changes (1 = admitted next)."""

    type: Literal["queued"] = "queued"
    position: int = Field(ge=1)
    waited_ms: int = Field(ge=0)


class HostBusy(Exception):
    def __init__(self, retry_after_s: int, waited_ms: int, position: int | None) -> None:
        super().__init__("host_busy")
        self.retry_after_s = retry_after_s
        self.waited_ms = waited_ms
        self.position = position


@dataclass(eq=False)
class Ticket:
    user_id: str
    chat: Chat
    job_id: str
    on_position: Callable[[QueuedEvent], None]
    enqueued: float = field(default_factory=time.monotonic)
    granted: anyio.Event = field(default_factory=anyio.Event)
    placement: Placement | None = None
    position: int | None = None

    def waited_ms(self) -> int:
        return int((time.monotonic() - self.enqueued) * 1000)


@dataclass(frozen=True)
class Grant:
    chat: Chat
    victim: Chat | None  # a sandbox to stop before this job's own starts
    waited_s: float
    queued: bool


class Admission:
    def __init__(self, *, max_turns: int | None, timeout_s: float, room: SandboxRoom) -> None:
        self.max_turns = max_turns
        self.timeout_s = timeout_s
        self.room = room
        self.running = 0
        self.queue: FairQueue[Ticket] = FairQueue()
        self.host_busy = 0

    @property
    def depth(self) -> int:
        return len(self.queue)

    def retry_after_s(self) -> int:
        return max(1, math.ceil(self.timeout_s))

    def position_of(self, user_id: str, job_id: str) -> int | None:
        for ticket, pos in self.queue.positions().items():
            if (ticket.user_id, ticket.job_id) == (user_id, job_id):
                return pos
        return None

    def admits_at_once(self, chat: Chat) -> bool:
        """A job for ``chat`` would be granted now: nobody waits, a turn slot is free, and its
        sandbox needs no room another one has to give up."""
        return (not self.queue and (self.max_turns is None or self.running < self.max_turns)
                and self.room.fits_at_once(chat))

    async def admit(self, user_id: str, chat_id: str, job_id: str,
                    on_position: Callable[[QueuedEvent], None]) -> Grant:
        ticket = Ticket(user_id=user_id, chat=(user_id, chat_id), job_id=job_id, on_position=on_position)
        self.queue.push(user_id, ticket)
        self.dispatch()
        if not ticket.granted.is_set():
            deadline = ticket.enqueued + self.timeout_s
            try:
                # To the monotonic clock's deadline, not one scope: a loop's timer may fire up to a
                # millisecond early (uvloop's are millisecond-grained), and host_busy's waited_ms
                # is the whole queue timeout at least.
                while not ticket.granted.is_set() and (left := deadline - time.monotonic()) > 0:
                    with anyio.move_on_after(left):
                        await ticket.granted.wait()
            except BaseException:
                self._abandon(ticket)
                raise
            if not ticket.granted.is_set():
                position = ticket.position
                self._abandon(ticket)
                self.host_busy += 1
                raise HostBusy(self.retry_after_s(), ticket.waited_ms(), position)
        assert ticket.placement is not None
        return Grant(chat=ticket.chat, victim=ticket.placement.victim,
                     waited_s=time.monotonic() - ticket.enqueued, queued=ticket.position is not None)

    def _abandon(self, ticket: Ticket) -> None:
        if ticket.granted.is_set():  # granted as the wait was cancelled: give the slot back
            self.release(Grant(ticket.chat, None, 0.0, True))
        else:
            self.queue.remove(ticket.user_id, ticket)
            self.dispatch()

    def release(self, grant: Grant) -> None:
        self.running -= 1
        self.room.release(grant.chat)
        self.dispatch()

    def dispatch(self) -> None:
        """Admit from the front of the fair queue while there are slots and room; then tell
        every job still waiting whose place changed."""
        while self.queue and (self.max_turns is None or self.running < self.max_turns):
            head = self.queue.peek()
            assert head is not None
            placement = self.room.place(head.chat)
            if placement is None:
                break  # the front job waits for room; nobody overtakes it
            self.queue.pop()
            self.running += 1
            head.placement = placement
            head.granted.set()
        for ticket, pos in self.queue.positions().items():
            if pos != ticket.position:
                ticket.position = pos
                ticket.on_position(QueuedEvent(position=pos, waited_ms=ticket.waited_ms()))
