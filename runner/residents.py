"""Resident CLI processes: one per member while the daemon keeps it (LIVE turns)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import structlog

from drivers.base import NativeSession, wait_closed
from drivers.models import Locator
from drivers.transport import TransportClosed

log = structlog.get_logger("residents")

MemberKey = tuple[str, str, str]  # (user_id, chat_id, member_id)


@dataclass
class Resident:
    key: MemberKey
    runtime: str
    session: NativeSession
    container_id: str
    pidfile: str  # names the group whose tree the memory budget reads (the keeper's, when there is one)
    kill: Callable[[], Awaitable[None]]  # kills the process group inside the sandbox
    aclose: Callable[[], Awaitable[None]]  # closes our end of the stream
    last_used: float = field(default_factory=time.monotonic)
    made_ns: int = field(default_factory=time.time_ns)  # wall clock, before its CLI started
    relay_socket: str | None = None  # the keeper's socket: its relay (our attached exec) is read with the tree
    host_init_pid: int | None = None  # the sandbox's init, seen from the host (memory readings)
    pgid: int | None = None  # in the sandbox, read from the pidfile once
    measured_bytes: int | None = None  # its process tree's peak RSS at the last reading (budgeted)
    rss_bytes: int | None = None  # its process tree's RSS at the last reading
    keeper: Any = None  # runner.keepers.KeeperHandle: the CLI runs under an in-sandbox keeper

    @property
    def alive(self) -> bool:
        return self.session.transport.alive

    @property
    def locator(self) -> Locator | None:
        return self.session.locator


class ResidentPool:
    def __init__(self, grace_s: float = 3.0, forget: Callable[[MemberKey], Awaitable[None]] | None = None) -> None:
        self._residents: dict[MemberKey, Resident] = {}
        # Retired but not yet dead: their memory is still in use until the kill completes.
        self._retiring: list[Resident] = []
        self.grace_s = grace_s
        self.forget = forget  # drops a retired member's keeper record (runner.keepers)

    def get(self, key: MemberKey) -> Resident | None:
        return self._residents.get(key)

    def add(self, resident: Resident) -> None:
        self._residents[resident.key] = resident

    def keys(self) -> list[MemberKey]:
        return list(self._residents)

    def residents(self) -> list[Resident]:
        return list(self._residents.values())

    def retiring(self) -> list[Resident]:
        return list(self._retiring)

    def __len__(self) -> int:
        return len(self._residents)

    def is_resident(self, key: MemberKey) -> bool:
        r = self._residents.get(key)
        return r is not None and r.alive

    async def retire(self, key: MemberKey, why: str) -> bool:
        """Graceful close (stdin EOF), then kill the whole process group in the sandbox."""
        r = self._residents.pop(key, None)
        if r is None:
            return False
        self._retiring.append(r)
        try:
            await self._end(r)
        finally:
            self._retiring.remove(r)
        log.info("resident.retired", runtime=r.runtime, why=why)
        return True

    async def _end(self, r: Resident) -> None:
        with anyio.CancelScope(shield=True):
            try:
                with anyio.move_on_after(self.grace_s):
                    await r.session.close()
                    # Let the CLI exit on its own after stdin EOF: Claude 2.1.220 writes the
                    # last reply to its transcript up to ~0.1 s after `result`, and a signal
                    # in that window loses it from the native history.
                    await wait_closed(r.session.transport, self.grace_s)
            except TransportClosed as exc:
                # the process was already gone (its sandbox stopped or removed under it): nothing to close
                log.info("resident.already_gone", detail=str(exc))
            except Exception as exc:  # noqa: BLE001 - retiring must always finish
                log.warning("resident.close_failed", error=repr(exc))
            try:
                await r.kill()
            except Exception as exc:  # noqa: BLE001
                log.warning("resident.kill_failed", error=repr(exc))
            try:
                await r.aclose()
            except Exception:  # noqa: BLE001
                pass
            if r.keeper is not None and self.forget is not None:
                try:
                    await self.forget(r.key)
                except Exception as exc:  # noqa: BLE001 - a stale record is refused at the next start
                    log.warning("resident.forget_failed", error=repr(exc))

    async def detach_all(self) -> int:
        """Daemon shutdown (SPEC 14): end our attaches only; keepers and CLIs live on and the
        next daemon re-adopts them. A resident without a keeper is retired."""
        n = 0
        for key in list(self._residents):
            r = self._residents[key]
            if r.keeper is None:
                await self.retire(key, "daemon shutdown")
                continue
            self._residents.pop(key, None)
            with anyio.CancelScope(shield=True):
                try:
                    await r.keeper.channel.detach()
                except Exception as exc:  # noqa: BLE001
                    log.warning("resident.detach_failed", error=repr(exc))
            n += 1
        log.info("residents.detached", n=n)
        return n

    async def retire_where(self, pred: Callable[[Resident], bool], why: str) -> int:
        n = 0
        for key in [k for k, r in self._residents.items() if pred(r)]:
            n += await self.retire(key, why)
        return n

    async def retire_all(self, why: str) -> int:
        return await self.retire_where(lambda r: True, why)
