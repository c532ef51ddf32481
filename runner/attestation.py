"""Host attestation (SPEC section 9.4): which source, image and engine serve jobs here,
whether the sandbox path works end to end right now, and a fresh heartbeat.

A working model call proves nothing about which revision is serving; this document does:
the exact git SHA of the running source, the image the sandboxes are created from and its
pins, a reverse probe that exercises the daemon's own sandbox path, and the heartbeat.
"""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import anyio
import structlog

from images.checks import check_image_labels
from images.pins import load_pins
from runner.config import Settings
from runner.openapi import API_VERSION
from runner.supervisor import Supervisor
from sandbox_manager.engine import ContainerSpec

log = structlog.get_logger("attestation")

SOURCE_ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class SourceIdentity:
    sha: str | None
    dirty: bool | None
    origin: str


def source_identity(root: Path = SOURCE_ROOT) -> SourceIdentity:
    """The exact commit of the code this process runs, read once at start."""
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
        return SourceIdentity(sha=sha or None, dirty=bool(status.strip()), origin="git")
    except (OSError, subprocess.SubprocessError):
        stamp = root / "SOURCE_SHA"
        if stamp.exists():
            return SourceIdentity(sha=stamp.read_text().strip() or None, dirty=None, origin="SOURCE_SHA file")
        return SourceIdentity(sha=None, dirty=None, origin="unknown")


@dataclass
class ProbeResult:
    ok: bool
    at: datetime
    steps_ms: dict[str, int] = field(default_factory=dict)
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "at": self.at.isoformat(), "steps_ms": self.steps_ms, "error": self.error}


class Attestor:
    def __init__(self, settings: Settings, supervisor: Supervisor, *, probe_interval_s: float = 300.0) -> None:
        self.settings = settings
        self.sup = supervisor
        self.source = source_identity()
        self.probe_interval_s = probe_interval_s
        self.last_probe: ProbeResult | None = None
        self._probe_lock = anyio.Lock()

    async def probe(self) -> ProbeResult:
        """Reverse probe: engine ping, image inspect, a throwaway exec in a probe container."""
        async with self._probe_lock:
            steps: dict[str, int] = {}
            engine = self.sup.engine
            cid = None
            t_all = time.monotonic()
            try:
                t = time.monotonic()
                if not await engine.ping():
                    raise RuntimeError("engine did not answer ping")
                steps["ping"] = int((time.monotonic() - t) * 1000)
                t = time.monotonic()
                image = await self.sup.manager.checked_image(self.sup.manager.config.image)
                steps["image_inspect"] = int((time.monotonic() - t) * 1000)
                t = time.monotonic()
                info = await engine.create(ContainerSpec(
                    image=image.id, name=f"ca-probe-{uuid.uuid4().hex[:12]}",
                    labels={"org.cloud-agent.probe": "1", "org.cloud-agent.host-id": self.sup.manager.config.host_id},
                    network="none", memory_bytes=256 * 1024**2, pids_limit=64))
                cid = info.id
                await engine.start(cid)
                steps["create_start"] = int((time.monotonic() - t) * 1000)
                t = time.monotonic()
                code, out = await engine.exec_run(cid, ["ca-launch", "--pidfile", "/tmp/probe.pid", "--", "id", "-u"])
                if code != 0 or out.strip() != b"1000":
                    raise RuntimeError(f"probe exec returned {code}: {out[:200]!r}")
                steps["exec"] = int((time.monotonic() - t) * 1000)
                result = ProbeResult(ok=True, at=datetime.now(UTC), steps_ms=steps)
            except Exception as exc:  # noqa: BLE001 - the probe reports, it does not raise
                result = ProbeResult(ok=False, at=datetime.now(UTC), steps_ms=steps, error=str(exc)[:500])
            finally:
                if cid is not None:
                    with anyio.CancelScope(shield=True):
                        try:
                            t = time.monotonic()
                            await engine.remove(cid)
                            steps["remove"] = int((time.monotonic() - t) * 1000)
                        except Exception:  # noqa: BLE001
                            pass
            steps["total"] = int((time.monotonic() - t_all) * 1000)
            self.last_probe = result
            log.info("attestation.probe", ok=result.ok, steps_ms=steps, error=result.error)
            return result

    async def _probe_loop(self) -> None:
        while True:
            await self.probe()
            await anyio.sleep(self.probe_interval_s)

    @asynccontextmanager
    async def running(self) -> AsyncIterator["Attestor"]:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._probe_loop)
            try:
                yield self
            finally:
                tg.cancel_scope.cancel()

    async def image_document(self) -> dict[str, Any]:
        ref = self.sup.manager.config.image
        try:
            img = await self.sup.engine.image(ref)
        except Exception as exc:  # noqa: BLE001
            return {"ref": ref, "error": str(exc)[:300]}
        pins = load_pins()
        return {"ref": ref, "id": img.id, "labels": img.labels,
                "helper_version": img.labels.get(pins.helper.name),
                "problems": check_image_labels(img.labels, require_helper=self.sup.manager.config.require_helper)}

    async def document(self) -> dict[str, Any]:
        pins = load_pins()
        try:
            version = await self.sup.engine.version()
            engine = {"reachable": True, "version": version.get("Version"), "api_version": version.get("ApiVersion")}
        except Exception as exc:  # noqa: BLE001
            engine = {"reachable": False, "error": str(exc)[:300]}
        try:
            engine["data_root_id"] = await self.sup.manager.current_data_root_id()
        except Exception:  # noqa: BLE001
            engine["data_root_id"] = None
        hb = self.sup.heartbeat
        return {
            "source": {"sha": self.source.sha, "dirty": self.source.dirty, "origin": self.source.origin},
            "api_version": API_VERSION,
            "host_id": self.sup.manager.config.host_id,
            "daemon": {"owner": self.sup.owner, "started_at": self.sup.started_at.isoformat()},
            "image": await self.image_document(),
            "required_helper": {"name": pins.helper.name, "version": pins.helper.version},
            "pins": {runtime: pin.spec for runtime, pin in pins.cli.items()} | {"node": pins.node.version},
            "engine": engine,
            "reverse_probe": self.last_probe.as_dict() if self.last_probe else None,
            "heartbeat": {"last_beat": hb.last_beat.isoformat() if hb.last_beat else None,
                          "interval_s": hb.interval_s, "beats": hb.beats,
                          "now": datetime.now(UTC).isoformat()},
            "residents": len(self.sup.pool),
        }

    async def readiness(self) -> list[str]:
        reasons: list[str] = []
        if not await self.sup.engine.ping():
            reasons.append("engine_unreachable")
        else:
            img = await self.image_document()
            if "error" in img:
                reasons.append("image_missing")
            else:
                pins = load_pins()
                if img["helper_version"] != str(pins.helper.version):
                    reasons.append(f"helper_pin_mismatch: image has {img['helper_version']}, "
                                   f"pin is {pins.helper.version}")
                other = [p for p in img["problems"] if pins.helper.name not in p]
                if other:
                    reasons.append("image_pins_mismatch: " + "; ".join(other))
        if not self.source.sha:
            reasons.append("source_sha_unknown")
        if self.last_probe is None:
            reasons.append("reverse_probe_pending")
        elif not self.last_probe.ok:
            reasons.append(f"reverse_probe_failed: {self.last_probe.error}")
        return reasons
