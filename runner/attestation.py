"""Host attestation (SPEC section 9.4): which source, image and engine serve jobs here,
whether the sandbox path works end to end right now, and a fresh heartbeat.

A working model call proves nothing about which revision is serving; this document does:
the exact git SHA of the running source (and whether the tree was dirty), the image the
sandboxes are created from with its digest and pins, a reverse probe that exercises the
daemon's own sandbox path (engine ping, image check, a throwaway container from the image,
an exec through ``ca-launch``), and the heartbeat. ``readiness()`` turns the same facts into
named reasons for ``/readyz``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import structlog

from images.checks import check_image_labels
from runner.control_plane import HeartbeatPublisher
from runner.openapi import API_VERSION
from runner.probe import ProbeResult, ReverseProbe
from runner.supervisor import Supervisor

log = structlog.get_logger("attestation")

SOURCE_ROOT = Path(__file__).resolve().parent.parent
PROBE_RETRY_AFTER_FAILURE_S = 10.0
HEARTBEAT_GRACE_S = 5.0


@dataclass(frozen=True)
class SourceIdentity:
    sha: str | None
    dirty: bool | None
    origin: str  # git | SOURCE_SHA file | unknown
    read_at: datetime


def _git(root: Path, *args: str) -> str:
    # GIT_DIR / GIT_WORK_TREE in the daemon's environment must not point git at another tree.
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10,
                          check=True, env=env).stdout


def source_identity(root: Path = SOURCE_ROOT) -> SourceIdentity:
    """The exact commit of the code this process runs, read once at start.

    Dirty means the tree differs from that commit: modified tracked files or untracked,
    not ignored files (an untracked module can be imported just as well).
    """
    at = datetime.now(UTC)
    try:
        top = Path(_git(root, "rev-parse", "--show-toplevel").strip()).resolve()
        if top == root.resolve():
            sha = _git(root, "rev-parse", "--verify", "HEAD").strip()
            status = _git(root, "status", "--porcelain", "--untracked-files=normal")
            return SourceIdentity(sha=sha or None, dirty=bool(status.strip()), origin="git", read_at=at)
    except (OSError, subprocess.SubprocessError):
        pass
    stamp = root / "SOURCE_SHA"  # written by a packaging step where there is no git checkout
    if stamp.is_file():
        sha = stamp.read_text().strip()
        return SourceIdentity(sha=sha or None, dirty=None, origin="SOURCE_SHA file", read_at=at)
    return SourceIdentity(sha=None, dirty=None, origin="unknown", read_at=at)


class Attestor:
    def __init__(self, supervisor: Supervisor, *, probe_interval_s: float = 60.0, probe_timeout_s: float = 60.0,
                 publisher: HeartbeatPublisher | None = None, source: SourceIdentity | None = None) -> None:
        self.sup = supervisor
        self.source = source or source_identity()
        self.probe_interval_s = probe_interval_s
        self.prober = ReverseProbe(supervisor.engine, supervisor.manager, timeout_s=probe_timeout_s)
        self.publisher = publisher

    @property
    def probe_stale_after_s(self) -> float:
        """A result older than this means the probe loop stopped (or hangs): not fresh evidence."""
        return 2 * self.probe_interval_s + self.prober.timeout_s

    @property
    def heartbeat_stale_after_s(self) -> float:
        return 2 * self.sup.heartbeat.interval_s + HEARTBEAT_GRACE_S

    async def probe(self) -> ProbeResult:
        return await self.prober.run()

    async def _probe_loop(self) -> None:
        while True:
            result = await self.prober.run()
            # after a failure, look again soon: readiness should not wait a whole period
            await anyio.sleep(self.probe_interval_s if result.ok
                              else min(self.probe_interval_s, PROBE_RETRY_AFTER_FAILURE_S))

    @asynccontextmanager
    async def running(self) -> AsyncIterator["Attestor"]:
        log.info("attestation.source", sha=self.source.sha, dirty=self.source.dirty, origin=self.source.origin)
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._probe_loop)
            if self.publisher is not None:
                tg.start_soon(self.publisher.run)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    # -- the document ----------------------------------------------------------------------------

    async def image_document(self) -> dict[str, Any]:
        ref = self.sup.manager.config.image
        try:
            img = await self.sup.engine.image(ref)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return {"ref": ref, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        pins = self.sup.manager.config.pinned
        # The image id is the digest of its config (content-addressed): the exact image,
        # whatever tag points at it. The image is built locally, so it has no registry digest.
        return {"ref": ref, "id": img.id, "digest": img.id, "tags": list(img.tags), "labels": img.labels,
                "helper_version": img.labels.get(pins.helper.name),
                "problems": check_image_labels(img.labels, pins=pins,
                                               require_helper=self.sup.manager.config.require_helper)}

    async def engine_document(self) -> dict[str, Any]:
        try:
            version = await self.sup.engine.version()
            engine: dict[str, Any] = {"reachable": True, "version": version.get("Version"),
                                      "api_version": version.get("ApiVersion")}
        except Exception as exc:  # noqa: BLE001
            return {"reachable": False, "error": f"{type(exc).__name__}: {str(exc)[:300]}", "data_root_id": None}
        try:
            engine["data_root_id"] = await self.sup.manager.current_data_root_id()
        except Exception:  # noqa: BLE001
            engine["data_root_id"] = None
        return engine

    def heartbeat_document(self) -> dict[str, Any]:
        hb = self.sup.heartbeat
        now = datetime.now(UTC)
        age = (now - hb.last_beat).total_seconds() if hb.last_beat else None
        return {"last_beat": hb.last_beat.isoformat() if hb.last_beat else None, "interval_s": hb.interval_s,
                "beats": hb.beats, "now": now.isoformat(), "age_s": None if age is None else round(age, 3),
                "stale_after_s": self.heartbeat_stale_after_s,
                "stale": age is None or age > self.heartbeat_stale_after_s}

    def probe_document(self) -> dict[str, Any] | None:
        last = self.prober.last
        if last is None:
            return None
        age = (datetime.now(UTC) - last.finished_at).total_seconds()
        return last.as_dict() | {"age_s": round(age, 3), "interval_s": self.probe_interval_s,
                                 "stale_after_s": self.probe_stale_after_s, "stale": age > self.probe_stale_after_s}

    async def document(self) -> dict[str, Any]:
        pins = self.sup.manager.config.pinned
        reasons, detail = await self.readiness()
        return {
            "source": {"sha": self.source.sha, "dirty": self.source.dirty, "origin": self.source.origin,
                       "read_at": self.source.read_at.isoformat()},
            "api_version": API_VERSION,
            "host_id": self.sup.manager.config.host_id,
            "daemon": {"owner": self.sup.owner, "started_at": self.sup.started_at.isoformat(), "pid": os.getpid()},
            "image": await self.image_document(),
            "required_helper": {"name": pins.helper.name, "version": pins.helper.version},
            "pins": {runtime: pin.spec for runtime, pin in pins.cli.items()} | {"node": pins.node.version},
            "engine": await self.engine_document(),
            "reverse_probe": self.probe_document(),
            "heartbeat": self.heartbeat_document(),
            "dependencies": {"control_plane": self.publisher.status() if self.publisher else None},
            "residents": len(self.sup.pool),
            "readiness": {"ready": not reasons, "reasons": reasons, "detail": detail},
        }

    # -- readiness ---------------------------------------------------------------------------------

    async def readiness(self) -> tuple[list[str], dict[str, str]]:
        """Named reasons the host must not take jobs (empty: ready), with a detail per reason."""
        detail: dict[str, str] = {}
        if not await self.sup.engine.ping():
            detail["engine_unreachable"] = "the engine did not answer a ping"
        else:
            img = await self.image_document()
            if "error" in img:
                detail["image_missing"] = f"{img['ref']}: {img['error']}"
            else:
                pins = self.sup.manager.config.pinned
                if img["helper_version"] != str(pins.helper.version):
                    detail["helper_pin_mismatch"] = (f"image has {pins.helper.name}={img['helper_version']}, "
                                                     f"the pin is {pins.helper.version}")
                other = [p for p in img["problems"] if pins.helper.name not in p]
                if other:
                    detail["image_pins_mismatch"] = "; ".join(other)
        if not self.source.sha:
            detail["source_sha_unknown"] = "neither git nor a SOURCE_SHA file names the running source"
        probe = self.probe_document()
        if probe is None:
            detail["reverse_probe_pending"] = "no reverse probe has finished yet"
        elif not probe["ok"]:
            detail["reverse_probe_failed"] = f"{probe['failed_step']}: {probe['error']}"
        elif probe["stale"]:
            detail["reverse_probe_stale"] = f"last probe {probe['age_s']:.0f}s ago"
        hb = self.heartbeat_document()
        if hb["stale"]:
            detail["heartbeat_stale"] = "no beat yet" if hb["age_s"] is None else f"last beat {hb['age_s']:.0f}s ago"
        return list(detail), detail
