"""The reverse probe: the daemon exercises its own sandbox path end to end.

engine ping -> sweep of leftover probe containers -> the engine's data-root identity (created
when missing, as for a new sandbox) -> image check (the same
``checked_image`` that gates sandbox creation) -> create + start a throwaway container from
that image with the sandboxes' settings -> an exec through ``ca-launch`` as ``agent`` -> the
helper binary's own version against the image label -> remove. Every step is timed.

Probe containers never leak: the container is removed in a shielded ``finally`` (by name
when ``create`` failed half-way), the whole probe runs under a timeout, and every probe
first sweeps probe containers of this host that outlived a probe (a daemon killed mid-probe).
They carry only the probe label, never a sandbox label, so nothing mistakes them for a chat.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import anyio
import structlog

from images.pins import load_pins
from sandbox_manager.engine import ContainerInfo, ContainerSpec, Engine, NotFound
from sandbox_manager.sandboxes import SandboxManager

log = structlog.get_logger("probe")

PROBE_LABEL = "org.cloud-agent.probe"  # value: the host id
PROBE_MEMORY_BYTES = 256 * 1024**2
PROBE_PIDS = 64
AGENT_UID = b"1000"
# The version line of the helper on PATH, or, when that is a stub compiled at the image's build
# (images/sandbox/compile_helpers.py), of the source its code was compiled from (the stub names it).
HELPER_VERSION_SCRIPT = (
    'p=$(command -v "$1") || { echo missing; exit 0; }; '
    "v() { sed -n 's/^BRIDGE_VERSION *= *\\([0-9][0-9]*\\).*/\\1/p' \"$1\" | head -n 1; }; "
    's=$(v "$p"); '
    "src=$(sed -n 's/^# [^ ]*: its code was compiled at the image.s build .*; the source is \\(\\/.*\\)$/\\1/p' \"$p\" "
    "| head -n 1); "
    '[ -z "$s" ] && [ -n "$src" ] && [ -f "$src" ] && s=$(v "$src"); '
    'echo "$s"'
)


class ProbeFailed(Exception):
    pass


@dataclass
class ProbeResult:
    ok: bool
    started_at: datetime
    finished_at: datetime
    steps_ms: dict[str, int] = field(default_factory=dict)
    failed_step: str | None = None
    error: str | None = None
    image_id: str | None = None
    helper_binary_version: str | None = None
    swept: int = 0
    removed: bool = True  # False only when the probe container could not be removed

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "at": self.finished_at.isoformat(), "started_at": self.started_at.isoformat(),
                "steps_ms": self.steps_ms, "failed_step": self.failed_step, "error": self.error,
                "image_id": self.image_id, "helper_binary_version": self.helper_binary_version,
                "swept": self.swept, "removed": self.removed}


def _created(info: ContainerInfo) -> datetime | None:
    raw = str(info.attrs.get("Created") or "")
    if not raw:
        return None
    head, _, frac = raw.rstrip("Z").partition(".")
    try:
        return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00")
    except ValueError:
        return None


class ReverseProbe:
    def __init__(self, engine: Engine, manager: SandboxManager, *, timeout_s: float = 60.0) -> None:
        self.engine = engine
        self.manager = manager
        self.timeout_s = timeout_s
        self.last: ProbeResult | None = None
        self._lock = anyio.Lock()

    @property
    def label(self) -> str:
        return f"{PROBE_LABEL}={self.manager.config.host_id}"

    async def sweep(self, older_than_s: float) -> int:
        """Remove this host's probe containers older than ``older_than_s`` (twice the probe
        timeout: a probe in flight elsewhere is younger than that and is left alone)."""
        now = datetime.now(UTC)
        removed = 0
        for info in await self.engine.list_labelled(self.label):
            created = _created(info)
            if created is not None and (now - created).total_seconds() < older_than_s:
                continue
            try:
                await self.engine.remove(info.id)
                removed += 1
            except NotFound:
                pass
        if removed:
            log.warning("probe.swept", containers=removed)
        return removed

    async def run(self) -> ProbeResult:
        async with self._lock:
            result = await self._run()
            self.last = result
            log.info("probe.finished", ok=result.ok, failed_step=result.failed_step, error=result.error,
                     steps_ms=result.steps_ms, swept=result.swept)
            return result

    async def _run(self) -> ProbeResult:
        cfg = self.manager.config
        name = f"ca-probe-{uuid.uuid4().hex[:16]}"
        result = ProbeResult(ok=False, started_at=datetime.now(UTC), finished_at=datetime.now(UTC))
        steps = result.steps_ms
        step = "ping"
        created = False
        t_all = time.monotonic()

        async def timed(name_: str, coro: Any) -> Any:
            nonlocal step
            step = name_
            t = time.monotonic()
            value = await coro
            steps[name_] = int((time.monotonic() - t) * 1000)
            return value

        try:
            with anyio.fail_after(self.timeout_s):
                if not await timed("ping", self.engine.ping()):
                    raise ProbeFailed("the engine did not answer a ping")
                result.swept = await timed("sweep", self.sweep(older_than_s=2 * self.timeout_s))
                await timed("data_root", self.manager.data_root_id())  # what new sandboxes are labelled with
                image = await timed("image_inspect", self.manager.checked_image(cfg.image))
                result.image_id = image.id
                spec = ContainerSpec(image=image.id, name=name, labels={PROBE_LABEL: cfg.host_id},
                                     memory_bytes=min(cfg.memory_bytes, PROBE_MEMORY_BYTES),
                                     pids_limit=PROBE_PIDS, nano_cpus=cfg.nano_cpus)
                created = True  # from here on a container may exist, even if create raises
                info = await timed("create", self.engine.create(spec))
                await timed("start", self.engine.start(info.id))
                code, out = await timed("exec", self.engine.exec_run(
                    info.id, ["ca-launch", "--pidfile", "/tmp/ca-probe.pid", "--", "id", "-u"]))
                if code != 0 or out.strip() != AGENT_UID:
                    raise ProbeFailed(f"ca-launch id -u exited {code}: {out[:200]!r}")
                helper_name = load_pins().helper.name
                helper = image.labels.get(helper_name)
                if helper is not None:
                    code, out = await timed("helper", self.engine.exec_run(
                        info.id, ["sh", "-c", HELPER_VERSION_SCRIPT, "sh", helper_name]))
                    seen = out.decode(errors="replace").strip()
                    result.helper_binary_version = seen or None
                    if seen == "missing":
                        raise ProbeFailed(f"the image claims {helper_name}={helper} but has no such helper")
                    if seen and seen != helper:
                        raise ProbeFailed(f"the helper binary is version {seen}, the image label says {helper}")
                result.ok = True
        except TimeoutError:
            result.failed_step, result.error = step, f"timed out after {self.timeout_s:g}s"
        except Exception as exc:  # noqa: BLE001 - the probe reports, it does not raise
            result.failed_step, result.error = step, f"{type(exc).__name__}: {str(exc)[:400]}"
        finally:
            if created:
                t = time.monotonic()
                with anyio.CancelScope(shield=True), anyio.move_on_after(30) as scope:
                    try:
                        await self.engine.remove(name)  # by name: works even if create raised late
                    except NotFound:
                        pass
                    except Exception as exc:  # noqa: BLE001 - the next probe's sweep retries
                        result.removed = False
                        log.error("probe.remove_failed", container=name, error=repr(exc))
                if scope.cancelled_caught:
                    result.removed = False
                    log.error("probe.remove_failed", container=name, error="timed out")
                steps["remove"] = int((time.monotonic() - t) * 1000)
            steps["total"] = int((time.monotonic() - t_all) * 1000)
            result.finished_at = datetime.now(UTC)
        return result
