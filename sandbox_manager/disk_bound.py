"""Each sandbox's disk bound (CLOUD_AGENT_SANDBOX_DISK_MB): a writable-layer quota where the
engine's storage driver takes one, else a measured limit (sandbox_manager.disk_usage); the
chat's state volume (SPEC 15) is always measured (no layer quota covers it).

Whether the driver takes a quota is learnt from the engine, not assumed: the first create
asks for one, and an engine that refuses ``--storage-opt`` (overlay2 on anything but xfs with
``pquota``) is asked no more. A sandbox over its measured limit is stopped with reason
``disk_quota`` (runner.disk_watch) and stays refused until a fresh scan of its layer is
under the bound: the operator raised the bound, or freed space in the layer.
"""

from __future__ import annotations

import os
from dataclasses import replace

import anyio
import structlog

from sandbox_manager import disk_usage
from sandbox_manager.disk_usage import DiskUsage
from sandbox_manager.engine import ContainerInfo, ContainerSpec, Engine, EngineError, NotFound
from state.records import SandboxRecord
from state.store import Store

log = structlog.get_logger("sandbox.disk")

DISK_QUOTA = "disk_quota"


class SandboxRefused(Exception):
    """The sandbox is intact but kept stopped (``reason``: disk_quota): turns are refused."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class DiskBound:
    def __init__(self, engine: Engine, store: Store, limit_bytes: int | None) -> None:
        self.engine = engine
        self.store = store
        self.limit_bytes = limit_bytes
        self.quota_supported: bool | None = None  # None: not asked yet

    async def create(self, spec: ContainerSpec) -> ContainerInfo:
        if self.limit_bytes is None or self.quota_supported is False:
            return await self.engine.create(spec)
        try:
            info = await self.engine.create(replace(spec, disk_bytes=self.limit_bytes))
        except EngineError as exc:
            if "storage-opt" not in str(exc):
                raise
            self.quota_supported = False
            log.info("sandbox.disk_quota_unsupported", detail=str(exc)[:200],
                     fallback="measured limit (writable-layer scans)")
            return await self.engine.create(spec)
        self.quota_supported = True
        return info

    async def usage(self, rec: SandboxRecord) -> DiskUsage | None:
        """The measured use of a sandbox: its writable layer (unless the engine enforces a quota
        for it) plus its state volume (no layer quota covers a volume). None when nothing can be
        read from here (a remote engine)."""
        if self.limit_bytes is None:
            return None
        info = await self.engine.inspect(rec.container_id)
        paths: list[str] = []
        if not (info.attrs.get("HostConfig", {}).get("StorageOpt") or {}).get("size"):
            upper = (info.attrs.get("GraphDriver", {}).get("Data") or {}).get("UpperDir")
            if upper and os.path.isdir(upper):
                paths.append(upper)
        if rec.volume_name is not None:
            try:
                vol = await self.engine.inspect_volume(rec.volume_name)
            except NotFound:
                vol = None  # gone: the next turn finds it LOST
            if vol is not None and vol.mountpoint and os.path.isdir(vol.mountpoint):
                paths.append(vol.mountpoint)
        if not paths:
            return None
        return await anyio.to_thread.run_sync(disk_usage.scan_all, paths, self.limit_bytes)

    async def recheck(self, rec: SandboxRecord) -> None:
        """Before a turn on a sandbox stopped for disk_quota: still over → SandboxRefused;
        under the bound now → the block is cleared and the turn goes on."""
        usage = await self.usage(rec)
        if usage is not None and usage.over:
            raise SandboxRefused(DISK_QUOTA, usage.why)
        await self.store.set_stop_reason(rec.user_id, rec.chat_id, None)
        log.info("sandbox.disk_quota_cleared", container=rec.container_name,
                 used=None if usage is None else usage.bytes)
