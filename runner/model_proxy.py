"""The model proxy with what it needs to keep the wire ledger: the :class:`proxy.ProxyHost`,
the :class:`~runner.proxy_attribution.Attribution` of its sockets and members, and the
:class:`~runner.proxy_attribution.LedgerSink` into the store.

One object, two homes: the proxy service's process runs it behind its control socket
(``runner.proxy_service``, the default: it outlives daemon restarts, SPEC 14), and the daemon
runs it itself with ``CLOUD_AGENT_PROXY_PROCESS=daemon``. Every operation is async and
idempotent, so the daemon can send its whole view again after it reconnects.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from typing import Protocol

import structlog
from prometheus_client import CollectorRegistry

from proxy import ProxyConfig, ProxyHost, ProxyMetrics
from proxy.exchange import Rewrite
from runner.proxy_attribution import Attribution, LedgerSink
from state.contract import StoreContract

log = structlog.get_logger("model_proxy")


class ProxyOps(Protocol):
    """What the daemon asks of its model proxy, wherever the proxy runs."""

    async def open(self, chat_key: str, user_id: str, chat_id: str, directory: Path) -> Path: ...
    async def close(self, chat_key: str) -> None: ...
    async def flush(self, chat_key: str, timeout_s: float, end_of: tuple[str, str] | None = None) -> None: ...
    async def member(self, chat_key: str, member_key: str, member_id: str) -> None: ...
    async def begin(self, chat_key: str, member_key: str, member_id: str, job_id: str) -> None: ...
    async def end(self, chat_key: str, member_key: str, job_id: str) -> None: ...
    async def keep_turns(self, job_ids: list[str]) -> None: ...


class ModelProxy:
    def __init__(self, config: ProxyConfig, store: StoreContract, *, registry: CollectorRegistry | None = None,
                 rewrite: Rewrite | None = None) -> None:
        self.attribution = Attribution()
        self.metrics = ProxyMetrics(registry)
        # rewrite: the test seam of runner.hooks.TestHooks (a callable: in the daemon's process only)
        self.sink = LedgerSink(store, self.attribution)
        self.host = ProxyHost(config, sink=self.sink, turn_of=self.attribution.turn_of,
                              metrics=self.metrics, rewrite=rewrite)

    async def __aenter__(self) -> ModelProxy:
        await self.host.__aenter__()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.host.__aexit__(exc_type, exc, tb)

    # -- sockets ------------------------------------------------------------------------------

    async def open(self, chat_key: str, user_id: str, chat_id: str, directory: Path) -> Path:
        """Listen on ``directory/model.sock`` for the chat (the same path again: a no-op)."""
        self.attribution.open_chat(chat_key, user_id, chat_id)
        return await self.host.open_sandbox(chat_key, directory, user_id=user_id)

    async def close(self, chat_key: str) -> None:
        await self.host.close_sandbox(chat_key)  # its last records still find the chat
        self.attribution.close_chat(chat_key)
        self.sink.forget_chat(chat_key)

    async def flush(self, chat_key: str, timeout_s: float, end_of: tuple[str, str] | None = None) -> None:
        """Every request of the chat that reached the proxy has its record; then, with
        ``end_of=(member_key, job_id)``, that member's requests no longer belong to the job
        (:meth:`end` in the same call: one round trip per turn fewer, issue 16)."""
        try:
            await self.host.flush(chat_key, timeout_s)
        finally:
            if end_of is not None:
                self.attribution.end(chat_key, *end_of)

    # -- members and turns --------------------------------------------------------------------

    async def member(self, chat_key: str, member_key: str, member_id: str) -> None:
        self.attribution.member(chat_key, member_key, member_id)

    async def begin(self, chat_key: str, member_key: str, member_id: str, job_id: str) -> None:
        self.attribution.begin(chat_key, member_key, member_id, job_id)

    async def end(self, chat_key: str, member_key: str, job_id: str) -> None:
        self.attribution.end(chat_key, member_key, job_id)

    async def keep_turns(self, job_ids: list[str]) -> None:
        forgotten = self.attribution.keep_turns(job_ids)
        if forgotten:
            log.info("model_proxy.turns_forgotten", job_ids=forgotten)

    # -- state --------------------------------------------------------------------------------

    def quiet(self, chat_key: str) -> bool:
        return self.host.quiet(chat_key)

    def in_flight(self) -> int:
        return self.host.in_flight()

    def open_sandboxes(self) -> int:
        return self.host.open_sandboxes()
