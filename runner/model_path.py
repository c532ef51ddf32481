"""The sandboxes' one way to the model, composed for the daemon (SPEC 7, 12, 14).

The model proxy (:class:`runner.model_proxy.ModelProxy`: one socket per sandbox at
``HOME/sockets/<container name>/model.sock``, mounted read-only into that sandbox, the wire
ledger sink, the map from a member's running job to the requests its CLI sends) runs in a
process of its own by default, the proxy service (``runner.proxy_service``), which outlives
daemon restarts: a reply streaming when the daemon dies still reaches its CLI, and the request
is attributed to the turn the next daemon finishes. ``CLOUD_AGENT_PROXY_PROCESS=daemon`` runs
it in the daemon instead (a restart then breaks the streams in flight; the sockets come back at
the same paths, so a CLI's own retry reaches the new proxy). This module keeps the daemon's
view (sockets, members, running turns) to send the service again after a reconnect, and
decides each turn's wire verdict.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import structlog
from prometheus_client import CollectorRegistry
from pydantic import SecretStr

from drivers.models import GatewayConfig
from proxy import (
    Baseline,
    DigestEntry,
    ProxyConfig,
    VerdictMetrics,
    WireRecord,
    WireVerdict,
    baseline_after,
    member_base_url,
    placeholder_key,
    wire_verdict,
)
from proxy.stored_digest import BaselineRef, rebuild
from runner.baseline_cache import BaselineCache
from runner.config import LOOPBACK_KEY, Settings
from runner.model_proxy import ModelProxy, ProxyOps
from runner.proxy_client import ProxyServiceClient, ProxyServiceUnavailable
from runner.proxy_link import ProxyServiceError
from runner.proxy_metrics_relay import ProxyMetricsRelay
from runner.proxy_protocol import ServiceConfig, ServicePaths
from sandbox_manager.identity import container_name, member_key
from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.sealing import MODEL_PORT
from state.contract import StoreContract
from state.jobs import Job
from state.receipts import Outcome, Receipt, WireDifference, WireInfo
from state.records import MemberRecord, SandboxState
from state.wire_ledger import SettleQuery, WireSettleView, WireTurnRow

log = structlog.get_logger("model_path")

FLUSH_TIMEOUT_S = 10.0
METRICS_WAIT_S = 2.0


def proxy_config(settings: Settings, gateway_url: str) -> ProxyConfig:
    """The proxy's settings from the daemon's. Without a key file the gateway is the loopback
    fixture, whose fixed non-secret key is written to HOME for the proxy to read."""
    key_file = settings.gateway_key_file
    if key_file is None and settings.gateway_key_dir is None:
        key_file = settings.home / "loopback-gateway-key"
        settings.home.mkdir(parents=True, exist_ok=True)
        key_file.write_text(LOOPBACK_KEY + "\n")
    return ProxyConfig(upstream_url=gateway_url, key_file=key_file, key_dir=settings.gateway_key_dir,
                       capture=settings.wire_capture)


def service_config(settings: Settings, proxy: ProxyConfig) -> ServiceConfig:
    return ServiceConfig(home=settings.home, proxy=proxy, store_url=settings.store_url, store_path=settings.store_path,
                         linger_s=settings.proxy_linger_s)


@dataclass(frozen=True)
class _Chat:
    user_id: str
    chat_id: str


class ModelPath:
    def __init__(self, settings: Settings, gateway_url: str, store: StoreContract, manager: SandboxManager, *,
                 config: ProxyConfig | None = None, rewrite: Callable[[str, bytes], bytes] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.settings, self.store, self.manager = settings, store, manager
        self.config = config or proxy_config(settings, gateway_url)
        # the daemon's view, sent again to a service it reconnects to
        self.chats: dict[str, _Chat] = {}  # chat_key -> ids (registered when its socket opens)
        self.members: dict[tuple[str, str], str] = {}  # (chat_key, member_key) -> member_id
        self.jobs: dict[tuple[str, str], str] = {}  # (chat_key, member_key) -> running job id
        self.rewrite = rewrite  # test seam only (runner.turn.TestHooks.rewrite_model_request)
        # a Python callable cannot cross into the service: the seam runs the proxy in the daemon
        self.in_daemon = settings.proxy_process == "daemon" or rewrite is not None
        self.registry = registry if registry is not None else CollectorRegistry()
        self.verdict_metrics = VerdictMetrics(self.registry)  # SPEC 11: verdicts are the daemon's
        self.baselines = BaselineCache()  # the members' last baselines, parsed (runner.baseline_cache)
        # the proxy's request counters: its own in the daemon, relayed from the service's process
        self.relay = None if self.in_daemon else ProxyMetricsRelay(self.registry)
        self._ops: ProxyOps | None = None
        self._client: ProxyServiceClient | None = None
        # chat_key -> (the connection that opened its socket, the path): a turn's open is a
        # round trip to the service only when this connection has not opened it yet
        self._opened: dict[str, tuple[object, Path]] = {}
        if not self.in_daemon:
            ServicePaths(settings.home).check()  # the control socket's address fits, or the daemon does not start

    # -- lifecycle ----------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ModelPath]:
        if self.in_daemon:
            async with ModelProxy(self.config, self.store, registry=self.registry, rewrite=self.rewrite) as proxy:
                self._ops = proxy
                try:
                    await self._reopen()
                    yield self
                finally:
                    self._ops = None
            return
        client = ProxyServiceClient(service_config(self.settings, self.config), replay=self._replay)
        failure: Exception | None = None
        async with anyio.create_task_group() as tg:
            try:
                await tg.start(client.run)  # attached: the service answers, started if it did not
                self._ops, self._client = client, client
                await self._reopen()
                yield self
            except Exception as exc:  # raised below, as itself (the task group would wrap it in a group)
                failure = exc
            finally:
                self._ops = self._client = None
                tg.cancel_scope.cancel()  # our connection ends; the service serves on
        if failure is not None:
            raise failure

    async def _reopen(self) -> None:
        """SPEC 14: the sockets of this host's running sandboxes are open (again: the service
        kept them; a new service or proxy makes them at the same paths)."""
        try:
            records = await self.store.list_sandboxes(SandboxState.RUNNING)
        except Exception as exc:  # noqa: BLE001 - the store may be down; turns reopen on demand
            log.warning("model_path.reopen_failed", error=repr(exc))
            return
        for rec in records:
            if rec.host_id == self.manager.config.host_id:
                await self.open(rec.user_id, rec.chat_id)

    async def _replay(self, ops: ProxyOps) -> None:
        """Everything this daemon told the proxy, again (a new connection, maybe a new service)."""
        for key, chat in list(self.chats.items()):
            try:
                await ops.open(key, chat.user_id, chat.chat_id, self.manager.socket_dir(chat.user_id, chat.chat_id))
            except ProxyServiceError as exc:  # that chat's turns will say so; the others serve on
                log.error("model_path.reopen_refused", chat_key=key, error=str(exc))
        for (key, mk), member_id in list(self.members.items()):
            await ops.member(key, mk, member_id)
        for (key, mk), job_id in list(self.jobs.items()):
            await ops.begin(key, mk, self.members.get((key, mk), ""), job_id)

    def _proxy(self) -> ProxyOps:
        if self._ops is None:
            raise RuntimeError("the model proxy is not running")
        return self._ops

    async def _tell(self, what: str, call: Callable[[ProxyOps], Awaitable[None]]) -> None:
        """An update the proxy may miss while it is unreachable: the next connection replays it."""
        try:
            await call(self._proxy())
        except ProxyServiceUnavailable as exc:
            log.warning("model_path.proxy_unreachable", update=what, error=str(exc))

    # -- sockets ------------------------------------------------------------------------------

    @staticmethod
    def chat_key(user_id: str, chat_id: str) -> str:
        return container_name(user_id, chat_id)

    async def open(self, user_id: str, chat_id: str) -> Path:
        """The chat's socket listens (idempotent). Every turn asks; once this connection to the
        proxy has opened it, the answer is known (a reconnect replays every open: ``_replay``)."""
        key = self.chat_key(user_id, chat_id)
        self.chats[key] = _Chat(user_id, chat_id)
        link = self._client.link if self._client is not None else self._ops
        known = self._opened.get(key)
        if known is not None and link is not None and known[0] is link:
            return known[1]
        path = await self._proxy().open(key, user_id, chat_id, self.manager.socket_dir(user_id, chat_id))
        if link is not None:
            self._opened[key] = (link, path)
        return path

    async def close(self, user_id: str, chat_id: str) -> None:
        key = self.chat_key(user_id, chat_id)
        self.chats.pop(key, None)
        self._opened.pop(key, None)
        for table in (self.members, self.jobs):
            for k in [k for k in table if k[0] == key]:
                del table[k]
        if self._ops is not None:
            await self._tell("close", lambda p: p.close(key))

    def forget_chat(self, user_id: str, chat_id: str) -> None:
        """The chat was deleted: no member of it has a next verdict (its kept baselines go)."""
        self.baselines.forget_chat(user_id, chat_id)

    # -- members and turns --------------------------------------------------------------------

    async def gateway(self, user_id: str, chat_id: str, member_id: str, model: str) -> GatewayConfig:
        """What a member's CLI is configured with: its own base URL and a placeholder key.
        A member whose turn has begun is known to the proxy already: the begin names it, and
        went out on the same connection before anything of the turn that launches the CLI (a
        NEW or RESTORED turn made a round trip to the proxy more for it, issue 16)."""
        key = self.chat_key(user_id, chat_id)
        mk = member_key(member_id)
        self.members[(key, mk)] = member_id
        if (key, mk) not in self.jobs:  # no turn of the member begun (a fork's new member, a re-adopt)
            await self._tell("member", lambda p: p.member(key, mk, member_id))
        return GatewayConfig(base_url=member_base_url(MODEL_PORT, mk), key=SecretStr(placeholder_key(key)),
                             model=model)

    async def begin(self, job: Job) -> None:
        """The member's requests belong to ``job`` from now on (until ``end``)."""
        key, mk = self.chat_key(job.user_id, job.chat_id), member_key(job.member_id)
        self.members[(key, mk)] = job.member_id
        self.jobs[(key, mk)] = job.job_id
        await self._tell("begin", lambda p: p.begin(key, mk, job.member_id, job.job_id))

    async def end(self, job: Job) -> None:
        """The member's requests no longer belong to ``job``. Idempotent: once ended (or when a
        later turn of the member began) there is nothing to tell — the proxy's view is this one,
        replayed on every connection."""
        key, mk = self.chat_key(job.user_id, job.chat_id), member_key(job.member_id)
        if self._take_job(key, mk, job.job_id):
            await self._tell("end", lambda p: p.end(key, mk, job.job_id))

    def _take_job(self, key: str, mk: str, job_id: str) -> bool:
        """The member's requests stop belonging to ``job_id`` here (and in every replay); False
        when they already had (ended, or a later turn of the member began)."""
        if self.jobs.get((key, mk)) != job_id:
            return False
        del self.jobs[(key, mk)]
        return True

    async def keep_turns(self, job_ids: list[str]) -> None:
        """After a restart: the proxy forgets the running turns a dead daemon left but these
        (the ones being finished); their CLIs' requests belonged to them meanwhile."""
        await self._tell("keep_turns", lambda p: p.keep_turns(job_ids))

    async def refresh_metrics(self) -> None:
        """Before a scrape: the service's counters, as they are now."""
        if self.relay is None or self._client is None:
            return
        try:
            self.relay.update(await self._client.metrics(METRICS_WAIT_S))
        except ProxyServiceUnavailable as exc:
            log.warning("model_path.metrics_unavailable", error=str(exc))
            self.relay.update(None)

    # -- the verdict --------------------------------------------------------------------------

    async def settle(self, receipt: Receipt, member: MemberRecord | None, *, message: str, compaction: bool,
                     settled_index: int) -> tuple[WireInfo, WireTurnRow]:
        """The turn's wire verdict and the ledger row to commit with its receipt, read apart
        from the commit (a turn's own commit judges inside it: ``Store.settle_job``)."""
        await self.flush(receipt)
        query = self.settle_query(receipt, member)
        view = await self.store.wire_settle_view(receipt.user_id, receipt.job_id, query)
        wire, row = self.judge(receipt, member, query, view, message=message, compaction=compaction,
                               settled_index=settled_index)
        self.count_verdict(receipt.runtime, wire)
        return wire, row

    def count_verdict(self, runtime: str, wire: WireInfo) -> None:
        """Once per committed verdict (a commit's retry may judge twice)."""
        self.verdict_metrics.observe(runtime, wire.history)

    async def flush(self, receipt: Receipt) -> None:
        """Every request of the turn's chat has its record, and the member's later requests no
        longer belong to the job (its ``end``, told with the flush): the verdict's view is final."""
        if self._ops is None:
            return
        key, mk = self.chat_key(receipt.user_id, receipt.chat_id), member_key(receipt.member_id)
        end_of = (mk, receipt.job_id) if self._take_job(key, mk, receipt.job_id) else None
        await self._tell("flush", lambda p: p.flush(key, FLUSH_TIMEOUT_S, end_of))

    def settle_query(self, receipt: Receipt, member: MemberRecord | None) -> SettleQuery:
        """The ledger view the verdict reads: the job's records and the member's standing (a
        fork with no turn of its own compares with its source at the fork point), and the
        record whose whole digest this daemon still holds (its last baseline's), which the
        view then need not read back."""
        if member is None:
            return SettleQuery(receipt.chat_id, None)
        fork = (member.forked_from, member.settled_turns) if member.forked_from is not None else None
        known = self.baselines.whole_digests((receipt.user_id, receipt.chat_id, member.member_id))
        return SettleQuery(receipt.chat_id, member.member_id, fork, known)

    def judge(self, receipt: Receipt, member: MemberRecord | None, query: SettleQuery, view: WireSettleView, *,
              message: str, compaction: bool, settled_index: int) -> tuple[WireInfo, WireTurnRow]:
        """The verdict from the view read with ``query``; pure, for it runs on the store's thread
        inside the commit's transaction, once per attempt (:meth:`count_verdict` counts it once
        it stands)."""
        known: Mapping[str, list[DigestEntry]] = query.known
        stored = {r.record_id: WireRecord.model_validate_json(r.record_json) for r in [*view.ancestors, *view.records]}
        whole = rebuild(stored, known)
        # seq restarts with each proxy process: renumber in the ledger's arrival order
        records = [whole[r.record_id].model_copy(update={"seq": i}) for i, r in enumerate(view.records)]

        def digest_of(record_id: str) -> list[DigestEntry] | None:  # read only when the cache misses
            record = whole.get(record_id)
            return record.digest if record is not None and record.digest is not None else known.get(record_id)

        own = view.expectation
        key = (receipt.user_id, receipt.chat_id, receipt.member_id)
        baseline: Baseline | None = None
        failed: list[str] = []
        if member is not None and own.conversational:
            if own.baseline_json is not None:
                baseline = self.baselines.get(key, own.baseline_json)
                if baseline is None:
                    baseline = _baseline(own.baseline_json, own.baseline_record, digest_of)
                    if baseline.conversation is not _UNREADABLE:  # never claim a digest nobody read
                        self.baselines.keep(key, own.baseline_json, baseline, own.baseline_record)
            failed = own.failed_texts
        elif member is not None and member.forked_from is not None and view.fork_baseline is not None:
            baseline = _baseline(view.fork_baseline, view.fork_baseline_record, digest_of)
        compaction = compaction or saw_summary(records)
        verdict = wire_verdict(records, baseline=baseline, message=message, failed_before=failed,
                               compaction=compaction, runtime=receipt.runtime)
        succeeded = receipt.outcome == Outcome.SUCCEEDED
        left = baseline_after(records, succeeded=succeeded)
        conversational = any(r.conversational and r.digest is not None for r in records)
        failed_text = message if receipt.outcome == Outcome.FAILED and conversational else None
        left_json = left_record = None
        if left is not None:
            # the record baseline_after took its conversation from: the turn's last conversational one
            left_record = next(row.record_id for row, r in zip(reversed(view.records), reversed(records), strict=True)
                               if r.conversational and r.digest is not None)
            left_json = BaselineRef(record_id=left_record, reply=left.reply).model_dump_json()
            self.baselines.keep(key, left_json, left, left_record)
        row = WireTurnRow(user_id=receipt.user_id, chat_id=receipt.chat_id, member_id=receipt.member_id,
                          job_id=receipt.job_id, settled_index=settled_index, outcome=receipt.outcome.value,
                          conversational=conversational, baseline_json=left_json,
                          failed_text=failed_text, created_at=datetime.now(UTC).isoformat(),
                          baseline_record=left_record)
        return to_wire_info(verdict), row

    async def purge_capture(self) -> int:
        before = datetime.now(UTC) - timedelta(days=self.settings.wire_capture_days)
        return await self.store.purge_wire_capture(before)

    async def purge_loop(self, period_s: float = 3600.0) -> None:
        """Captured texts older than CLOUD_AGENT_WIRE_CAPTURE_DAYS are deleted (digests stay)."""
        while True:
            try:
                n = await self.purge_capture()
                if n:
                    log.info("wire.capture_purged", records=n)
            except Exception as exc:  # noqa: BLE001 - the store may be away; try again next period
                log.warning("wire.capture_purge_failed", error=repr(exc))
            await anyio.sleep(period_s)


# Stands in for a baseline conversation the ledger cannot rebuild (its record is missing, which
# only a damaged store has): no request's digest matches it, so the verdict is a gap at its first
# entry, never a history the model was not shown to have seen.
_UNREADABLE = [DigestEntry("user", "0" * 64)]


def _baseline(text: str, record_id: str | None, digest_of: Callable[[str], list[DigestEntry] | None]) -> Baseline:
    """A stored baseline: a reference to its record (``BaselineRef``, with ``record_id``), or
    its whole conversation (written before migration 11)."""
    if record_id is None:
        return Baseline.model_validate_json(text)
    ref = BaselineRef.model_validate_json(text)
    conversation = digest_of(record_id)
    if conversation is None:
        log.error("wire.baseline_unreadable", record_id=record_id)
        conversation = _UNREADABLE
    return Baseline.model_construct(conversation=conversation, reply=ref.reply)


def saw_summary(records: list[WireRecord]) -> bool:
    """Compaction evidence the proxy sees itself: a summary request of the turn (the CLI asking
    the model to summarise its history, e.g. Claude and pi after a context-window refusal).
    Counts as the CLI's own compaction alongside the driver's evidence (SPEC 12 ``compacted``)."""
    return any(r.kind == "summary" and r.route is not None for r in records)


def to_wire_info(v: WireVerdict) -> WireInfo:
    diff = None
    if v.first_difference is not None:
        d = v.first_difference
        diff = WireDifference(index=d.index, role=d.role, expected_digest=d.expected_digest,
                              observed_digest=d.observed_digest)
    return WireInfo(requests=v.requests, side_requests=v.side_requests, history=v.history, first_difference=diff)
