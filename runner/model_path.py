"""The sandboxes' one way to the model, composed for the daemon (SPEC 7, 12, 14).

Owns the :class:`proxy.ProxyHost` (inside the supervisor's task group), one socket per
sandbox at ``HOME/sockets/<container name>/model.sock`` (mounted read-only into that sandbox),
the map from a member's running job to the requests its CLI sends (``turn_of``), the wire
ledger sink, and each turn's verdict. After a daemon restart every running sandbox of this
host gets its socket back at the same path before any turn runs, so a CLI's own retry reaches
the new proxy.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
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
    ProxyConfig,
    ProxyHost,
    ProxyMetrics,
    WireRecord,
    WireVerdict,
    baseline_after,
    member_base_url,
    placeholder_key,
    wire_verdict,
)
from runner.config import LOOPBACK_KEY, Settings
from sandbox_manager.identity import container_name, member_key
from sandbox_manager.sandboxes import SandboxManager
from sandbox_manager.sealing import MODEL_PORT
from state.contract import StoreContract
from state.jobs import Job
from state.receipts import Outcome, Receipt, WireDifference, WireInfo
from state.records import MemberRecord, SandboxState
from state.wire_ledger import WireRecordRow, WireTurnRow

log = structlog.get_logger("model_path")


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


@dataclass(frozen=True)
class _Chat:
    user_id: str
    chat_id: str


class LedgerSink:
    """:class:`proxy.WireSink` into the store: digests in ``record_json``, texts only with capture."""

    def __init__(self, store: StoreContract, path: ModelPath) -> None:
        self.store, self.path = store, path

    async def put(self, record: WireRecord) -> None:
        chat = self.path.chats.get(record.chat_key)
        if chat is None:
            return  # closed meanwhile; nothing to attribute it to
        member_id = self.path.members.get((record.chat_key, record.member_key or ""))
        captured = None
        if record.capture is not None or record.reply_capture is not None:
            captured = json.dumps({"request": [m.model_dump() for m in record.capture or []],
                                   "reply": [m.model_dump() for m in record.reply_capture or []]})
        body = record.model_dump_json(exclude={"capture", "reply_capture"})
        ordinal = f"{record.started_at.isoformat()}|{record.seq:012d}"
        await self.store.put_wire_record(WireRecordRow(
            record_id=uuid.uuid4().hex, user_id=chat.user_id, chat_id=chat.chat_id, member_id=member_id,
            job_id=record.job_id, ordinal=ordinal, record_json=body, capture_json=captured,
            created_at=datetime.now(UTC).isoformat()))


class ModelPath:
    def __init__(self, settings: Settings, gateway_url: str, store: StoreContract, manager: SandboxManager, *,
                 config: ProxyConfig | None = None, rewrite: Callable[[str, bytes], bytes] | None = None,
                 registry: CollectorRegistry | None = None) -> None:
        self.settings, self.store, self.manager = settings, store, manager
        self.config = config or proxy_config(settings, gateway_url)
        self.chats: dict[str, _Chat] = {}  # chat_key -> ids (registered when its socket opens)
        self.members: dict[tuple[str, str], str] = {}  # (chat_key, member_key) -> member_id
        self.jobs: dict[tuple[str, str], str] = {}  # (chat_key, member_key) -> running job id
        self.host: ProxyHost | None = None
        self.rewrite = rewrite  # test seam only (runner.turn.TestHooks.rewrite_model_request)
        # proxy requests by route and status, wire verdicts (SPEC 11), on the daemon's registry
        self.proxy_metrics = ProxyMetrics(registry)

    # -- lifecycle ----------------------------------------------------------------------------

    @asynccontextmanager
    async def running(self) -> AsyncIterator[ModelPath]:
        async with ProxyHost(self.config, sink=LedgerSink(self.store, self), turn_of=self.turn_of,
                             metrics=self.proxy_metrics, rewrite=self.rewrite) as host:
            self.host = host
            try:
                await self._reopen()
                yield self
            finally:
                self.host = None

    async def _reopen(self) -> None:
        """SPEC 14: the sockets of this host's running sandboxes come back at the same paths."""
        try:
            records = await self.store.list_sandboxes(SandboxState.RUNNING)
        except Exception as exc:  # noqa: BLE001 - the store may be down; turns reopen on demand
            log.warning("model_path.reopen_failed", error=repr(exc))
            return
        for rec in records:
            if rec.host_id == self.manager.config.host_id:
                await self.open(rec.user_id, rec.chat_id)

    def _host(self) -> ProxyHost:
        if self.host is None:
            raise RuntimeError("the model proxy is not running")
        return self.host

    # -- sockets ------------------------------------------------------------------------------

    @staticmethod
    def chat_key(user_id: str, chat_id: str) -> str:
        return container_name(user_id, chat_id)

    async def open(self, user_id: str, chat_id: str) -> Path:
        key = self.chat_key(user_id, chat_id)
        self.chats[key] = _Chat(user_id, chat_id)
        return await self._host().open_sandbox(key, self.manager.socket_dir(user_id, chat_id), user_id=user_id)

    async def close(self, user_id: str, chat_id: str) -> None:
        key = self.chat_key(user_id, chat_id)
        if self.host is not None:
            await self.host.close_sandbox(key)
        self.chats.pop(key, None)

    # -- members and turns --------------------------------------------------------------------

    def turn_of(self, chat_key: str, member: str) -> str | None:
        return self.jobs.get((chat_key, member))

    def gateway(self, user_id: str, chat_id: str, member_id: str, model: str) -> GatewayConfig:
        """What a member's CLI is configured with: its own base URL and a placeholder key."""
        key = self.chat_key(user_id, chat_id)
        mk = member_key(member_id)
        self.members[(key, mk)] = member_id
        return GatewayConfig(base_url=member_base_url(MODEL_PORT, mk), key=SecretStr(placeholder_key(key)),
                             model=model)

    def begin(self, job: Job) -> None:
        key, mk = self.chat_key(job.user_id, job.chat_id), member_key(job.member_id)
        self.members[(key, mk)] = job.member_id
        self.jobs[(key, mk)] = job.job_id

    def end(self, job: Job) -> None:
        key = (self.chat_key(job.user_id, job.chat_id), member_key(job.member_id))
        if self.jobs.get(key) == job.job_id:
            del self.jobs[key]

    # -- the verdict --------------------------------------------------------------------------

    async def settle(self, receipt: Receipt, member: MemberRecord | None, *, message: str, compaction: bool,
                     settled_index: int) -> tuple[WireInfo, WireTurnRow]:
        """The turn's wire verdict and the ledger row that is committed with its receipt."""
        if self.host is not None:
            await self.host.flush(self.chat_key(receipt.user_id, receipt.chat_id))
        records = await self.records(receipt.user_id, receipt.chat_id, receipt.job_id)
        compaction = compaction or saw_summary(records)
        baseline, failed = await self._expectation(member)
        verdict = wire_verdict(records, baseline=baseline, message=message, failed_before=failed,
                               compaction=compaction, runtime=receipt.runtime)
        succeeded = receipt.outcome == Outcome.SUCCEEDED
        left = baseline_after(records, succeeded=succeeded)
        conversational = any(r.conversational and r.digest is not None for r in records)
        failed_text = message if receipt.outcome == Outcome.FAILED and conversational else None
        row = WireTurnRow(user_id=receipt.user_id, chat_id=receipt.chat_id, member_id=receipt.member_id,
                          job_id=receipt.job_id, settled_index=settled_index, outcome=receipt.outcome.value,
                          conversational=conversational, baseline_json=left.model_dump_json() if left else None,
                          failed_text=failed_text, created_at=datetime.now(UTC).isoformat())
        self.proxy_metrics.observe_verdict(receipt.runtime, verdict.history)
        return to_wire_info(verdict), row

    async def records(self, user_id: str, chat_id: str, job_id: str) -> list[WireRecord]:
        rows = await self.store.wire_records_of_job(user_id, chat_id, job_id)
        # seq restarts with each proxy process: renumber in the ledger's arrival order
        return [WireRecord.model_validate_json(r.record_json).model_copy(update={"seq": i})
                for i, r in enumerate(rows)]

    async def _expectation(self, member: MemberRecord | None) -> tuple[Baseline | None, list[str]]:
        """The baseline of the member's last conversational turn and the failed queries since.
        A fork with no turn of its own yet compares with its source at the fork point. Two
        short reads, whatever the chat's length (reading every turn made each turn of a long
        chat slower: 11% of a 300-turn profile)."""
        if member is None:
            return None, []
        own = await self.store.wire_expectation(member.user_id, member.chat_id, member.member_id)
        if not own.conversational and member.forked_from is not None:
            at = await self.store.wire_baseline_at(member.user_id, member.chat_id, member.forked_from,
                                                   member.settled_turns)
            return (Baseline.model_validate_json(at) if at else None), []
        if not own.conversational:
            return None, []
        return (Baseline.model_validate_json(own.baseline_json) if own.baseline_json else None), own.failed_texts

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
