"""The opt-in smoke chat of the deployment check (SPEC 9.4): ``python -m deploy.reliability URL
--expect-sha SHA --smoke claude,codex``.

Per runtime, a synthetic chat on the deployed host, through the daemon's own API:

  new       a first job: ``NEW``, succeeded; its container and locator are the chat's
  live      a follow-up: ``LIVE`` on the same container and locator, wire verdict ``complete``
  stop      the idle stop (``POST …/stop``): the sandbox is stopped, the same container kept
  restored  a follow-up: ``RESTORED`` on the same container and locator, wire ``complete``
  delete    ``DELETE`` the chat — always: after a failed step and on an interrupt too

Each step is one table row with its timing; the first failed step ends the chat (the rest are
``skip``). Runtimes run one after the other, one chat each. It makes real model calls on the host's
real gateway: the summary says what it cost, in model requests (from the receipts' wire
verdicts). The chat is deleted in a shielded scope, so a cancelled run (SIGINT/SIGTERM,
handled by :func:`run_smoke`) still removes what it made.
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import httpx

STEPS = ("new", "live", "stop", "restored", "delete")
DELETE_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class StepRow:
    name: str  # smoke.<runtime>.<step>
    result: str  # pass | fail | skip
    detail: str
    seconds: float | None = None

    @property
    def passed(self) -> bool:
        return self.result == "pass"


class StepFailed(Exception):
    pass


@dataclass
class SmokeChat:
    runtime: str
    run_id: str
    rows: list[StepRow] = field(default_factory=list)
    requests: int = 0
    side_requests: int = 0
    container: str | None = None
    locator: str | None = None

    @property
    def user_id(self) -> str:
        return f"smoke-{self.run_id}"

    @property
    def chat_id(self) -> str:
        return f"smoke-{self.runtime}-{self.run_id}"

    @property
    def path(self) -> str:
        return f"/v1/users/{self.user_id}/chats/{self.chat_id}"

    def job(self, step: str, message: str) -> dict[str, Any]:
        return {"job_id": f"{self.chat_id}-{step}", "user_id": self.user_id, "chat_id": self.chat_id,
                "member_id": "smoke", "runtime": self.runtime, "message": message}


@dataclass(frozen=True)
class SmokeResult:
    rows: list[StepRow]
    requests: int
    side_requests: int
    interrupted: bool

    @property
    def ok(self) -> bool:
        return not self.interrupted and all(r.passed for r in self.rows)


MESSAGES = {
    "new": "This is an automated deployment check. Please reply with one short sentence.",
    "live": "Thank you. Please reply with one more short sentence.",
    "restored": "Last one: please reply with a final short sentence.",
}


async def _job(client: httpx.AsyncClient, chat: SmokeChat, step: str) -> dict[str, Any]:
    async with client.stream("POST", "/v1/jobs", json=chat.job(step, MESSAGES[step])) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise StepFailed(f"POST /v1/jobs answered HTTP {resp.status_code}: {resp.text[:200]}")
        receipt = None
        async for line in resp.aiter_lines():
            if line.strip():
                event = json.loads(line)
                if event.get("type") == "receipt":
                    receipt = event["receipt"]
                elif event.get("type") == "error":
                    raise StepFailed(f"the job stream ended with {event.get('error')}: {event.get('detail')}")
    if receipt is None:
        raise StepFailed("the job stream ended without a receipt")
    wire = receipt.get("wire") or {}
    chat.requests += int(wire.get("requests") or 0)
    chat.side_requests += int(wire.get("side_requests") or 0)
    return receipt


def _check_turn(chat: SmokeChat, receipt: dict[str, Any], status: str) -> str:
    got = (receipt.get("context_status"), receipt.get("outcome"))
    if got != (status, "succeeded"):
        reason = f" ({receipt.get('reason')})" if receipt.get("reason") else ""
        raise StepFailed(f"expected {status} succeeded, got {got[0]} {got[1]}{reason}")
    container = (receipt.get("sandbox") or {}).get("container_id")
    locator = receipt.get("locator_after")
    if chat.container is None:
        if not container or not locator:
            raise StepFailed(f"the receipt names no container ({container}) or locator ({locator})")
        chat.container, chat.locator = container, locator
    if container != chat.container:
        raise StepFailed(f"container changed: {str(chat.container)[:12]} -> {str(container)[:12]}")
    if locator != chat.locator or (status != "NEW" and receipt.get("locator_before") != chat.locator):
        raise StepFailed(f"locator changed: {chat.locator} -> {receipt.get('locator_before')} -> {locator}")
    history = (receipt.get("wire") or {}).get("history")
    want = "new" if status == "NEW" else "complete"
    if history != want:
        first = (receipt.get("wire") or {}).get("first_difference")
        raise StepFailed(f"wire verdict {history}, expected {want}" + (f" (first difference {first})" if first else ""))
    return f"{status} in {str(container)[:12]}, locator {locator}, wire {history}"


async def _stop(client: httpx.AsyncClient, chat: SmokeChat) -> str:
    resp = await client.post(f"{chat.path}/stop")
    if resp.status_code != 200 or resp.json() != {"stopped": True}:
        raise StepFailed(f"POST {chat.path}/stop answered HTTP {resp.status_code}: {resp.text[:200]}")
    status = await client.get(chat.path)
    sandbox = (status.json() if status.status_code == 200 else {}).get("sandbox") or {}
    if (sandbox.get("state"), sandbox.get("container_id")) != ("stopped", chat.container):
        raise StepFailed(f"after the stop the chat has sandbox {sandbox.get('state')} "
                         f"{str(sandbox.get('container_id'))[:12]}, expected stopped {str(chat.container)[:12]}")
    return f"stopped, container {str(chat.container)[:12]} kept"


async def _steps(client: httpx.AsyncClient, chat: SmokeChat) -> None:
    actions: dict[str, Callable[[], Awaitable[str]]] = {
        "new": lambda: _turn(client, chat, "new", "NEW"),
        "live": lambda: _turn(client, chat, "live", "LIVE"),
        "stop": lambda: _stop(client, chat),
        "restored": lambda: _turn(client, chat, "restored", "RESTORED"),
    }
    for step, action in actions.items():
        t = time.monotonic()
        try:
            detail = await action()
        except StepFailed as exc:
            chat.rows.append(StepRow(f"smoke.{chat.runtime}.{step}", "fail", str(exc), time.monotonic() - t))
            return
        except httpx.HTTPError as exc:
            chat.rows.append(StepRow(f"smoke.{chat.runtime}.{step}", "fail", f"{type(exc).__name__}: {exc}",
                                     time.monotonic() - t))
            return
        except anyio.get_cancelled_exc_class():
            chat.rows.append(StepRow(f"smoke.{chat.runtime}.{step}", "fail", "interrupted", time.monotonic() - t))
            raise
        chat.rows.append(StepRow(f"smoke.{chat.runtime}.{step}", "pass", detail, time.monotonic() - t))


async def _turn(client: httpx.AsyncClient, chat: SmokeChat, step: str, status: str) -> str:
    return _check_turn(chat, await _job(client, chat, step), status)


async def _delete(client: httpx.AsyncClient, chat: SmokeChat) -> None:
    t = time.monotonic()
    name = f"smoke.{chat.runtime}.delete"
    try:
        with anyio.fail_after(DELETE_TIMEOUT_S):
            resp = await client.delete(chat.path)
    except (httpx.HTTPError, TimeoutError) as exc:
        chat.rows.append(StepRow(name, "fail", f"the chat may be left behind: {type(exc).__name__}: {exc}",
                                 time.monotonic() - t))
        return
    if resp.status_code == 404 and chat.container is None:
        detail = "nothing to delete (no job ran)"  # e.g. the first job was refused before any record
    elif resp.status_code != 200:
        chat.rows.append(StepRow(name, "fail", f"HTTP {resp.status_code}: {resp.text[:200]}", time.monotonic() - t))
        return
    else:
        body = resp.json()
        detail = (f"deleted: container removed {body.get('container_removed')}, "
                  f"{body.get('tombstoned_receipts')} receipts kept as tombstones")
    chat.rows.append(StepRow(name, "pass", detail, time.monotonic() - t))


async def _smoke_chat(client: httpx.AsyncClient, chat: SmokeChat) -> None:
    try:
        await _steps(client, chat)
    finally:
        # shielded: an interrupted or failed run still deletes the chat it made
        with anyio.CancelScope(shield=True):
            await _delete(client, chat)
        ran = {r.name: r for r in chat.rows}
        chat.rows[:] = [ran.get(f"smoke.{chat.runtime}.{s}")
                        or StepRow(f"smoke.{chat.runtime}.{s}", "skip", "not run: an earlier step failed")
                        for s in STEPS]


def plan(runtimes: list[str], run_id: str | None = None) -> list[SmokeChat]:
    run_id = run_id or uuid.uuid4().hex[:10]
    return [SmokeChat(r, run_id) for r in runtimes]


async def smoke(client: httpx.AsyncClient, chats: list[SmokeChat]) -> None:
    """Every chat's steps, one runtime after the other (a step's timing is the host's, not the
    smoke's own contention); cancel-safe: each chat is deleted whatever happens."""
    for chat in chats:
        await _smoke_chat(client, chat)


def summarize(chats: list[SmokeChat], *, interrupted: bool) -> SmokeResult:
    return SmokeResult(rows=[r for c in chats for r in c.rows], requests=sum(c.requests for c in chats),
                       side_requests=sum(c.side_requests for c in chats), interrupted=interrupted)


async def run_smoke(url: str, token: str, runtimes: list[str], *, timeout_s: float = 900.0,
                    transport: httpx.AsyncBaseTransport | None = None) -> SmokeResult:
    """:func:`smoke` with its own client; SIGINT or SIGTERM cancel it (the chats are deleted first)."""
    chats = plan(runtimes)
    interrupted = False
    headers = {"authorization": f"Bearer {token}"}
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, transport=transport,
                                 timeout=httpx.Timeout(timeout_s, connect=10.0)) as client:
        async with anyio.create_task_group() as tg:
            async def watch_signals() -> None:
                nonlocal interrupted
                with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                    async for _ in signals:
                        interrupted = True
                        tg.cancel_scope.cancel()
                        return

            async def run() -> None:
                try:
                    await smoke(client, chats)
                finally:
                    tg.cancel_scope.cancel()  # ends the signal watcher

            tg.start_soon(watch_signals)
            tg.start_soon(run)
    return summarize(chats, interrupted=interrupted)
