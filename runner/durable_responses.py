"""No response of the daemon starts or ends before every commit made so far is on durable
storage.

A turn's commit is written to the WAL and flushed by the store's flusher (state.store's
``settle_job``): the store's thread is free for the other chats' claims and records while the
disk works, and one flush covers every commit made meanwhile (issue 16). Such a commit is
visible to this process's readers from its COMMIT on, some hundreds of microseconds before it
is on disk, and the turn frames its receipt meanwhile. A receipt must not leave the host
before its commit could survive a power loss, whether the turn's own stream carries it or a
read does in that window (``GET /v1/jobs/{id}``, a repeated dispatch, the inspector). So a
response waits for :meth:`state.contract.StoreContract.sync` as it starts (what its handler
read) and as its body ends (what a stream produced since: a job's receipt is its last line,
sent with the body's end, runner.job_response). Nothing to wait for when no flush is pending
(a lock and two counters), and PostgreSQL answers only durable commits anyway.

A pure ASGI middleware (not Starlette's ``BaseHTTPMiddleware``): a job's NDJSON stream goes
through unbuffered, and only its start and its end wait.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from state.contract import StoreContract


def _waits(message: Message) -> bool:
    kind = message["type"]
    return kind == "http.response.start" or (kind == "http.response.body" and not message.get("more_body", False))


class DurableResponses:
    def __init__(self, app: ASGIApp, store: StoreContract) -> None:
        self.app = app
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        store = self.store

        async def send_durably(message: Message) -> None:
            if _waits(message):
                await store.sync()
            await send(message)

        await self.app(scope, receive, send_durably)
