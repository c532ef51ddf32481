"""Retained sandboxes: one container per (user_id, chat_id), checked before every turn.

A chat's container is created once from the pinned image and kept (stopped when idle,
its writable layer retained). Before every turn :meth:`SandboxManager.resolve` proves the
container is the one recorded: same id, same identity labels, the same engine data root,
an image with supported pins. A turn served by a live resident may take that proof from
facts the engine's event stream keeps fresh (sandbox_manager/integrity.py): dropped by any
event that could change them, and by any gap in the stream. Anything else is :class:`SandboxLost` with a named reason:
losing the container or the data root loses the native state, and that is reported, never
hidden by quietly creating a fresh container.
"""

from __future__ import annotations

import hashlib
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

import anyio
import structlog

from images.checks import check_image_labels
from sandbox_manager.disk_bound import DISK_QUOTA, DiskBound, SandboxRefused
from sandbox_manager.engine import ContainerInfo, ContainerSpec, Engine, FileEntry, ImageInfo, Mount, NotFound
from sandbox_manager.exec_stream import ExecStream
from sandbox_manager.integrity import Facts, IntegrityFacts
from state.records import SandboxRecord, SandboxState
from state.store import Store, now
from telemetry.turn_trace import mark

log = structlog.get_logger("sandbox")

LABEL_PREFIX = "org.cloud-agent"
LABEL_SANDBOX = f"{LABEL_PREFIX}.sandbox"
LABEL_IDENTITY = f"{LABEL_PREFIX}.identity"
LABEL_USER = f"{LABEL_PREFIX}.user-digest"
LABEL_CHAT = f"{LABEL_PREFIX}.chat-digest"
LABEL_HOST = f"{LABEL_PREFIX}.host-id"
LABEL_DATA_ROOT = f"{LABEL_PREFIX}.dataroot-id"

AGENT_HOME = "/home/agent"
WORKSPACE = f"{AGENT_HOME}/workspace"
MEMBERS_DIR = f"{AGENT_HOME}/members"
KILL_GRACE_S = 3.0  # a retired process group gets this long between TERM and KILL

# The model socket (SPEC 7, 12): the host proxy's per-sandbox directory is mounted read-only
# here, and the container's command forwards 127.0.0.1:MODEL_PORT to the socket inside it.
MODEL_DIR = "/run/cloud-agent/model"
MODEL_SOCKET = f"{MODEL_DIR}/model.sock"
MODEL_PORT = 18080
MODEL_GATE_READY = "modelgate.listening"
MODEL_GATE_COMMAND = ("ca-modelgate", "--socket", MODEL_SOCKET, "--listen", f"127.0.0.1:{MODEL_PORT}")


class LostReason(StrEnum):
    CONTAINER_MISSING = "container_missing"
    CONTAINER_REPLACED = "container_replaced"
    LABELS_MISMATCH = "labels_mismatch"
    DATA_ROOT_CHANGED = "data_root_changed"
    IMAGE_UNSUPPORTED = "image_unsupported"
    SANDBOX_UNRECORDED = "sandbox_unrecorded"
    PREVIOUSLY_LOST = "previously_lost"
    WRONG_HOST = "wrong_host"
    # Created before sandboxes were sealed (host networking, no model socket): it cannot be
    # sealed in place, and recreating it would lose its native state (issue 15 recreates).
    NOT_SEALED = "sandbox_not_sealed"


class SandboxLost(Exception):
    def __init__(self, reason: LostReason, detail: str = "") -> None:
        super().__init__(f"{reason.value}: {detail}" if detail else reason.value)
        self.reason = reason
        self.detail = detail


class ModelGateNotReady(Exception):
    """The container started but its model gate (ca-modelgate) did not report listening."""


class ImageRefused(Exception):
    """The configured image does not carry the pinned versions: no sandbox is created from it."""


def digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()


def container_name(user_id: str, chat_id: str) -> str:
    # Derived from a hash of the ids: no raw user input ever reaches a container name.
    return f"ca-{digest('sandbox', user_id, chat_id)[:24]}"


def member_key(member_id: str) -> str:
    return digest("member", member_id)[:16]


@dataclass(frozen=True)
class SandboxConfig:
    image: str
    socket_root: str | None = None  # host dir of the per-sandbox model socket dirs (HOME/sockets)
    host_id: str = "local"
    memory_bytes: int = 4 * 1024**3
    pids_limit: int = 1024
    nano_cpus: int = 2_000_000_000
    require_helper: bool = True
    gate_ready_timeout_s: float = 20.0
    disk_bytes: int | None = None  # per-sandbox disk bound (quota where supported, else measured)


@dataclass(frozen=True)
class Sandbox:
    record: SandboxRecord
    container: ContainerInfo
    image: ImageInfo
    created: bool = False  # this call created it
    started: bool = False  # this call started it (it was stopped)

    @property
    def container_id(self) -> str:
        return self.container.id

    @property
    def helper_version(self) -> str | None:
        return self.image.labels.get("http-agent-live-bridge")


@dataclass(frozen=True)
class Removal:
    container: bool  # a container of the chat was removed by this call
    volume: bool  # its state volume was removed by this call


@dataclass(frozen=True)
class MemberDirs:
    home: str
    workspace: str
    run_dir: str


@dataclass
class MemberProcess:
    """A CLI process in a sandbox: its attached stream and how to kill its group."""

    container_id: str
    stream: ExecStream
    pidfile: str


SandboxWatcher = Callable[[str, str, SandboxState], None]


class SandboxManager:
    def __init__(self, engine: Engine, store: Store, config: SandboxConfig) -> None:
        self.engine = engine
        self.store = store
        self.config = config
        self._watchers: list[SandboxWatcher] = []
        self.disk = DiskBound(engine, store, config.disk_bytes)
        # kept fresh by the engine's events while the supervisor runs IntegrityFacts.follow
        self.integrity = IntegrityFacts(engine)

    def watch(self, watcher: SandboxWatcher) -> None:
        """Call ``watcher(user_id, chat_id, state)`` whenever this manager runs, stops or loses a sandbox."""
        self._watchers.append(watcher)

    def _changed(self, user_id: str, chat_id: str, state: SandboxState) -> None:
        for watcher in self._watchers:
            watcher(user_id, chat_id, state)

    async def data_root_id(self) -> str:
        """The engine data root's identity, created on first use. Never cached: the data root
        can be swapped under a running daemon, and new sandboxes must carry the current one."""
        ident = await self.engine.data_root_identity(create=True)
        if not ident:
            raise RuntimeError("the engine data root has no identity and none could be created")
        return ident

    async def current_data_root_id(self) -> str | None:
        """Re-read from the engine: the data root may have been swapped. (Only a resident's
        facts carry it between turns, and any event of the marker volume or a stream gap drops them.)"""
        return await self.engine.data_root_identity(create=False)

    def identity_labels(self, user_id: str, chat_id: str, data_root_id: str) -> dict[str, str]:
        return {
            LABEL_SANDBOX: "1",
            LABEL_IDENTITY: digest("sandbox", user_id, chat_id),
            LABEL_USER: digest("user", user_id)[:32],
            LABEL_CHAT: digest("chat", chat_id)[:32],
            LABEL_HOST: self.config.host_id,
            LABEL_DATA_ROOT: data_root_id,
        }

    def socket_dir(self, user_id: str, chat_id: str) -> Path:
        """The host directory holding this sandbox's model socket (mounted at MODEL_DIR)."""
        if self.config.socket_root is None:
            raise ValueError("socket_root: the sandbox manager has no model socket directory configured")
        return Path(self.config.socket_root) / container_name(user_id, chat_id)

    async def _gate_ready(self, info: ContainerInfo, since: float) -> None:
        if not await self.engine.wait_log_line(info.id, MODEL_GATE_READY, since=since,
                                               timeout_s=self.config.gate_ready_timeout_s):
            raise ModelGateNotReady(f"{info.name}: ca-modelgate did not report listening within "
                                    f"{self.config.gate_ready_timeout_s}s")

    async def checked_image(self, ref: str) -> ImageInfo:
        img = await self.engine.image(ref)
        problems = check_image_labels(img.labels, require_helper=self.config.require_helper)
        if problems:
            raise ImageRefused(f"image {ref} ({img.id[:19]}) refused: " + "; ".join(problems))
        return img

    # -- resolve ------------------------------------------------------------------------------

    async def resolve(self, user_id: str, chat_id: str, *, create: bool = True, resident: bool = False) -> Sandbox:
        """The chat's retained sandbox, running and integrity-checked, or SandboxLost.

        ``resident``: a live resident process of this chat serves the turn. Only then may the
        check be answered from facts the engine's event stream kept fresh (a turn that
        launches a process always checks against the engine).
        """
        rec = await self.store.get_sandbox(user_id, chat_id)
        mark("sandbox_record")
        if rec is None:
            if not create:
                raise KeyError((user_id, chat_id))
            return await self._create(user_id, chat_id)
        if rec.state == SandboxState.LOST:
            raise SandboxLost(LostReason.PREVIOUSLY_LOST, rec.lost_reason or "")
        if (resident and rec.host_id == self.config.host_id and rec.state == SandboxState.RUNNING
                and rec.stop_reason != DISK_QUOTA
                and (facts := self.integrity.get(rec.container_id, rec.data_root_id)) is not None):
            mark("integrity_cached")
            self._changed(user_id, chat_id, SandboxState.RUNNING)
            return Sandbox(record=rec, container=facts.container, image=facts.image)
        token = self.integrity.token(rec.container_id)
        try:
            info, image = await self._check(rec)
        except SandboxLost as lost:
            await self.store.set_sandbox_state(user_id, chat_id, SandboxState.LOST, lost.reason.value)
            self._changed(user_id, chat_id, SandboxState.LOST)
            log.warning("sandbox.lost", container=rec.container_name, reason=lost.reason.value, detail=lost.detail)
            raise
        if rec.stop_reason == DISK_QUOTA:
            await self.disk.recheck(rec)
        started = False
        if not info.running:
            t = time.time()
            await self.engine.start(info.id)
            info = await self.engine.inspect(info.id)
            started = True
            log.info("sandbox.started", container=rec.container_name)
            await self._gate_ready(info, t)
        self.integrity.put(token, Facts(info, image, rec.data_root_id))
        if started or rec.state != SandboxState.RUNNING:
            # the record says running again; a running one's last use is written with the turn's commit
            await self.store.touch_sandbox(user_id, chat_id)
            mark("sandbox_touched")
        rec = rec.model_copy(update={"state": SandboxState.RUNNING, "last_used_at": now()})
        self._changed(user_id, chat_id, SandboxState.RUNNING)
        return Sandbox(record=rec, container=info, image=image, started=started)

    async def _check(self, rec: SandboxRecord) -> tuple[ContainerInfo, ImageInfo]:
        if rec.host_id != self.config.host_id:
            raise SandboxLost(LostReason.WRONG_HOST, f"recorded on host {rec.host_id}")
        current_root = await self.current_data_root_id()
        mark("data_root")
        if current_root != rec.data_root_id:
            raise SandboxLost(LostReason.DATA_ROOT_CHANGED,
                              f"created in data root {rec.data_root_id[:12]}, engine now has "
                              f"{(current_root or 'none')[:12]}")
        try:
            info = await self.engine.inspect(rec.container_id)
        except NotFound:
            raise SandboxLost(LostReason.CONTAINER_MISSING, f"container {rec.container_name} is gone") from None
        mark("container_inspect")
        if info.id != rec.container_id:
            raise SandboxLost(LostReason.CONTAINER_REPLACED, f"{info.id[:12]} is not {rec.container_id[:12]}")
        want = self.identity_labels(rec.user_id, rec.chat_id, rec.data_root_id)
        bad = sorted(k for k, v in want.items() if info.labels.get(k) != v)
        if bad:
            raise SandboxLost(LostReason.LABELS_MISMATCH, "labels differ: " + ", ".join(bad))
        self._check_sealed(rec, info)
        try:
            image = await self.engine.image(info.image_id)
        except NotFound:
            raise SandboxLost(LostReason.IMAGE_UNSUPPORTED, f"image {info.image_id[:19]} is gone") from None
        # Attest from the image the container runs, never from container labels (which a
        # create-time --label can override, protocols/image-build.md section 6).
        problems = check_image_labels(image.labels, require_helper=self.config.require_helper)
        if problems:
            raise SandboxLost(LostReason.IMAGE_UNSUPPORTED, "; ".join(problems))
        mark("image_inspect")
        return info, image

    def _check_sealed(self, rec: SandboxRecord, info: ContainerInfo) -> None:
        host = info.attrs.get("HostConfig") or {}
        network = host.get("NetworkMode")
        if network != "none":
            raise SandboxLost(LostReason.NOT_SEALED, f"created with network {network!r}; sandboxes are now sealed "
                              "(network none) and this one cannot be sealed in place")
        want = str(self.socket_dir(rec.user_id, rec.chat_id))
        mounts = [m for m in info.attrs.get("Mounts") or [] if m.get("Destination") == MODEL_DIR]
        if not mounts or mounts[0].get("Source") != want or mounts[0].get("RW", True):
            raise SandboxLost(LostReason.NOT_SEALED, f"no read-only model socket mount of {want} at {MODEL_DIR}")

    async def _create(self, user_id: str, chat_id: str) -> Sandbox:
        image = await self.checked_image(self.config.image)
        root = await self.data_root_id()
        name = container_name(user_id, chat_id)
        try:
            existing = await self.engine.inspect(name)
        except NotFound:
            existing = None
        if existing is not None:
            # A container with this identity but no record: the store lost track of it.
            raise SandboxLost(LostReason.SANDBOX_UNRECORDED, f"{name} exists without a record")
        sockets = self.socket_dir(user_id, chat_id)
        spec = ContainerSpec(image=image.id, name=name, labels=self.identity_labels(user_id, chat_id, root),
                             mounts=(Mount(str(sockets), MODEL_DIR, read_only=True),), command=MODEL_GATE_COMMAND,
                             memory_bytes=self.config.memory_bytes,
                             pids_limit=self.config.pids_limit, nano_cpus=self.config.nano_cpus)
        info = await self.disk.create(spec)
        t = time.time()
        await self.engine.start(info.id)
        info = await self.engine.inspect(info.id)
        ts = now()
        rec = SandboxRecord(user_id=user_id, chat_id=chat_id, container_id=info.id, container_name=name,
                            image_id=image.id, data_root_id=root, host_id=self.config.host_id,
                            state=SandboxState.RUNNING, created_at=ts, last_used_at=ts)
        await self.store.put_sandbox(rec)
        self._changed(user_id, chat_id, SandboxState.RUNNING)
        log.info("sandbox.created", container=name, image=image.id[:19], network="none")
        await self._gate_ready(info, t)
        return Sandbox(record=rec, container=info, image=image, created=True)

    async def expire(self, user_id: str, chat_id: str, reason: str) -> bool:
        """Retention: remove the container (its writable layer with it) and record the sandbox
        LOST with ``reason``; idempotent."""
        rec = await self.store.get_sandbox(user_id, chat_id)
        if rec is None or rec.state == SandboxState.LOST:
            return False
        try:
            await self.engine.remove(rec.container_id)
        except NotFound:
            pass
        await self.store.set_sandbox_state(user_id, chat_id, SandboxState.LOST, reason)
        self._changed(user_id, chat_id, SandboxState.LOST)
        log.info("sandbox.expired", container=rec.container_name, reason=reason)
        return True

    async def block(self, user_id: str, chat_id: str, reason: str) -> None:
        """Keep the sandbox stopped: from now on turns are refused with ``reason`` until it is
        cleared (the caller stops it)."""
        await self.store.set_stop_reason(user_id, chat_id, reason)

    # -- lifecycle ------------------------------------------------------------------------------

    async def stop(self, user_id: str, chat_id: str) -> bool:
        """Idle-stop: the container stops, its writable layer (the native state) is kept."""
        rec = await self.store.get_sandbox(user_id, chat_id)
        if rec is None or rec.state == SandboxState.LOST:
            return False
        try:
            await self.engine.stop(rec.container_id)
        except NotFound:
            self._changed(user_id, chat_id, SandboxState.STOPPED)  # not running, whatever the record says
            return False
        await self.store.set_sandbox_state(user_id, chat_id, SandboxState.STOPPED)
        self._changed(user_id, chat_id, SandboxState.STOPPED)
        log.info("sandbox.stopped", container=rec.container_name)
        return True

    async def remove(self, user_id: str, chat_id: str) -> Removal:
        """Delete the chat's sandbox on this host's engine: its container (by the recorded id,
        and by name for one the store lost track of), its state volume and its model socket
        directory. Another host's sandbox is not this engine's to remove. Idempotent."""
        rec = await self.store.get_sandbox(user_id, chat_id)
        if rec is not None and rec.host_id != self.config.host_id:
            return Removal(container=False, volume=False)
        container = False
        for ref in dict.fromkeys(r for r in (rec.container_id if rec else None, container_name(user_id, chat_id)) if r):
            try:
                await self.engine.remove(ref)  # force: a running container and its processes end here
                container = True
            except NotFound:
                pass
        volume = await self._remove_volume(rec)
        if rec is not None:
            self._changed(user_id, chat_id, SandboxState.LOST)  # the capacity's room: it runs no more
        if self.config.socket_root is not None:
            sockets = self.socket_dir(user_id, chat_id)
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(sockets, ignore_errors=True))
        log.info("sandbox.removed", container=container_name(user_id, chat_id), removed=container, volume=volume)
        return Removal(container=container, volume=volume)

    async def _remove_volume(self, rec: SandboxRecord | None) -> bool:
        """The chat's state volume (SPEC 15). Sandboxes keep their native state in the writable
        layer until state volumes land: then this removes the recorded volume, and False says
        there was none."""
        return False

    # -- member processes ------------------------------------------------------------------------

    @staticmethod
    def member_dirs(member_id: str) -> MemberDirs:
        base = f"{MEMBERS_DIR}/{member_key(member_id)}"
        return MemberDirs(home=f"{base}/home", workspace=WORKSPACE, run_dir=f"{base}/run")

    async def prepare_files(self, sandbox: Sandbox, files: list[FileEntry], keep: list[FileEntry],
                            dirs: list[str]) -> None:
        """Write config files; ``keep`` files are written only when absent (the CLI may edit them)."""
        if keep:
            script = 'for f in "$@"; do [ -e "$f" ] && printf "%s\\n" "$f"; done; exit 0'
            code, out = await self.engine.exec_run(sandbox.container_id, ["sh", "-c", script, "sh",
                                                                          *[f.path for f in keep]])
            present = set(out.decode(errors="replace").splitlines())
            files = files + [f for f in keep if f.path not in present]
        if files or dirs:
            await self.engine.put_files(sandbox.container_id, files, dirs)

    async def launch(self, sandbox: Sandbox, *, argv: list[str], env: dict[str, str], workdir: str,
                     pidfile: str) -> MemberProcess:
        stream = await self.engine.exec_attached(sandbox.container_id, argv, env=env, workdir=workdir)
        return MemberProcess(container_id=sandbox.container_id, stream=stream, pidfile=pidfile)

    async def kill_group(self, container_id: str, pidfile: str) -> None:
        """Retire a process: kill its whole process group inside the container (TERM, then KILL
        after KILL_GRACE_S). Closing the exec client never ends the process inside (SPEC section 7).
        """
        tries = max(1, int(KILL_GRACE_S / 0.1))
        script = (
            'pg=$(cat "$1" 2>/dev/null) || exit 0; [ -n "$pg" ] || exit 0; '
            'kill -s TERM -- "-$pg" 2>/dev/null || { rm -f "$1"; exit 0; }; i=0; '
            f'while kill -s 0 -- "-$pg" 2>/dev/null; do i=$((i+1)); if [ $i -ge {tries} ]; then '
            'kill -s KILL -- "-$pg" 2>/dev/null; break; fi; sleep 0.1; done; rm -f "$1"'
        )
        try:
            await self.engine.exec_run(container_id, ["sh", "-c", script, "sh", pidfile])
        except NotFound:
            pass

    async def reap_orphans(self, keep: dict[str, set[str]] | None = None) -> int:
        """On daemon start: kill CLI process groups left in retained, running sandboxes, but
        those in ``keep`` (container id -> member run dirs of re-adopted keepers)."""
        killed = 0
        script = (
            f'for f in {MEMBERS_DIR}/*/run/*.pid; do [ -f "$f" ] || continue; d=${{f%/*}}; s=; '
            'for k in "$@"; do [ "$k" = "$d" ] && s=1; done; [ -n "$s" ] && continue; pg=$(cat "$f"); '
            '[ -n "$pg" ] && kill -s KILL -- "-$pg" 2>/dev/null && echo "$pg"; rm -f "$f"; done; exit 0'
        )
        for info in await self.engine.list_labelled(f"{LABEL_HOST}={self.config.host_id}"):
            if not info.running:
                continue
            kept = sorted((keep or {}).get(info.id, ()))
            code, out = await self.engine.exec_run(info.id, ["sh", "-c", script, "sh", *kept])
            n = len(out.split())
            if n:
                log.info("sandbox.reaped", container=info.name, groups=n)
            killed += n
        return killed
