"""Retained sandboxes: one container per (user_id, chat_id) on the chat's state volume,
both checked before every turn.

A chat's container is created from the pinned image with a named volume mounted at the
agent's home (workspace and native CLI state, SPEC 15) and kept (stopped when idle). Before
every turn :meth:`SandboxManager.resolve` proves the sandbox is the one recorded: the same
engine data root, the recorded volume (labels, mount, identity marker: ``sandbox_manager.
volumes``) and a container with the recorded id and identity labels. Then:

* the container is gone, the volume intact → a new container on the same volume
  (``recreated``; each member resumes through its CLI's own handshake);
* the container runs another image than the configured one → it is replaced by a container
  from the configured image on the same volume (``upgraded``; the old container's resident
  processes retired first). "Another image" is any image id other than the configured
  one's, older or newer, whatever it carries: an image with unsupported pins or helper never
  serves a turn, but its volume is upgraded all the same;
* a sandbox made before state volumes (no volume recorded) is migrated once
  (``sandbox_manager.migration``).

A turn served by a live resident may take that proof from facts the engine's event stream
keeps fresh (sandbox_manager/integrity.py): dropped by any event that could change them
(the chat's volume removed included), and by any gap in the stream.

Anything else is :class:`SandboxLost` with a named reason: losing the volume or the data
root loses the native state, and that is reported, never hidden by a fresh volume.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import anyio
import structlog

from sandbox_manager.chat_containers import ChatContainers, started_at
from sandbox_manager.creation import create_sandbox
from sandbox_manager.disk_bound import DISK_QUOTA
from sandbox_manager.engine import ContainerInfo, Engine, ImageInfo, NotFound
from sandbox_manager.identity import LostReason, Replaced, SandboxLost, container_name
from sandbox_manager.integrity import Facts
from sandbox_manager.member_processes import MemberProcesses
from sandbox_manager.migration import ASIDE_SUFFIX, migrate
from sandbox_manager.reads_at_once import read_at_once
from sandbox_manager.replacement import BeforeReplace, Replacement, replace
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sealing import GateReport
from sandbox_manager.volumes import check_marker, check_mount, judge_marker, judge_volume, volume_name
from state.records import SandboxRecord, SandboxState
from state.sandbox_writes import SeenSandbox
from state.store import Store, now
from telemetry.turn_trace import mark

log = structlog.get_logger("sandbox")


async def _nothing_resident(container_id: str) -> None:
    return None


BeforeStart = Callable[[], Awaitable[None]]


async def _nothing_first() -> None:
    return None


@dataclass(frozen=True)
class Removal:
    container: bool  # a container of the chat was removed by this call
    volume: bool  # its state volume was removed by this call


SandboxWatcher = Callable[[str, str, SandboxState], None]


class SandboxManager(ChatContainers, MemberProcesses):
    """The chat's sandboxes: made and checked as :class:`ChatContainers`, the member processes
    inside them are :class:`MemberProcesses`'."""

    def __init__(self, engine: Engine, store: Store, config: SandboxConfig) -> None:
        super().__init__(engine, store, config)
        self._chat_locks: dict[tuple[str, str], anyio.Lock] = {}
        self._watchers: list[SandboxWatcher] = []

    def watch(self, watcher: SandboxWatcher) -> None:
        """Call ``watcher(user_id, chat_id, state)`` whenever this manager runs, stops or loses a sandbox."""
        self._watchers.append(watcher)

    def _changed(self, user_id: str, chat_id: str, state: SandboxState) -> None:
        for watcher in self._watchers:
            watcher(user_id, chat_id, state)

    # -- resolve ------------------------------------------------------------------------------

    def _chat_lock(self, user_id: str, chat_id: str) -> anyio.Lock:
        return self._chat_locks.setdefault((user_id, chat_id), anyio.Lock(fast_acquire=True))

    async def resolve(self, user_id: str, chat_id: str, *, create: bool = True, resident: bool = False,
                      before_replace: BeforeReplace = _nothing_resident, seen: SeenSandbox | None = None,
                      before_start: BeforeStart = _nothing_first) -> Sandbox:
        """The chat's sandbox, running and integrity-checked, or SandboxLost.

        ``resident``: a live resident process of this chat serves the turn. Only then may the
        check be answered from facts the engine's event stream kept fresh (a turn that
        launches a process always checks against the engine).

        ``seen``: the chat's record as the job's claim read it; taken under the chat's lock
        instead of a read of its own when no write of the record can have landed since
        (state.sandbox_writes).

        ``before_start``: what must be done before anything of the chat's is created or started
        (the caller's model socket, which a container's command connects to as it starts). It
        runs beside the engine reads of a recorded sandbox's check, and has returned when this
        does; a record already LOST raises without it.

        The caller holds a use of the returned container until its turn ends
        (:meth:`release`): a replacement by another member's turn waits for it.
        """
        async with self._chat_lock(user_id, chat_id):
            sandbox = await self._resolve(user_id, chat_id, create, resident, before_replace, seen, before_start)
            self.uses.acquire(sandbox.container_id)
            return sandbox

    def release(self, sandbox: Sandbox) -> None:
        self.uses.release(sandbox.container_id)

    async def _resolve(self, user_id: str, chat_id: str, create: bool, resident: bool,
                       before_replace: BeforeReplace, seen: SeenSandbox | None, before_start: BeforeStart
                       ) -> Sandbox:
        if (seen is not None and (seen.user_id, seen.chat_id) == (user_id, chat_id)
                and self.store.sandbox_writes.current(seen)):
            rec = seen.record
        else:
            rec = await self.store.get_sandbox(user_id, chat_id)
        mark("sandbox_record")
        if rec is None:
            if not create:
                raise KeyError((user_id, chat_id))
            await before_start()
            sandbox = await create_sandbox(self, user_id, chat_id)
            self._changed(user_id, chat_id, SandboxState.RUNNING)
            return sandbox
        if rec.state == SandboxState.LOST:
            raise SandboxLost(LostReason.PREVIOUSLY_LOST, rec.lost_reason or "")
        if (resident and rec.host_id == self.config.host_id and rec.state == SandboxState.RUNNING
                and rec.stop_reason != DISK_QUOTA
                and (facts := self.integrity.get(rec.container_id, rec.data_root_id)) is not None):
            mark("integrity_cached")
            await before_start()
            self._changed(user_id, chat_id, SandboxState.RUNNING)
            return Sandbox(record=rec, container=facts.container, image=facts.image, from_events=True)
        try:
            sandbox = await self._resolve_recorded(rec, before_replace, before_start)
        except SandboxLost as lost:
            await self.store.set_sandbox_state(user_id, chat_id, SandboxState.LOST, lost.reason.value)
            self._changed(user_id, chat_id, SandboxState.LOST)
            log.warning("sandbox.lost", container=rec.container_name, reason=lost.reason.value, detail=lost.detail)
            raise
        self._changed(user_id, chat_id, SandboxState.RUNNING)
        return sandbox

    async def _resolve_recorded(self, rec: SandboxRecord, before_replace: BeforeReplace,
                                before_start: BeforeStart) -> Sandbox:
        # taken before the check: facts whose check raced an invalidating event are not kept
        token = self.integrity.token(rec.container_id)
        if rec.host_id != self.config.host_id:
            raise SandboxLost(LostReason.WRONG_HOST, f"recorded on host {rec.host_id}")
        volume = rec.volume_name
        first, root, image, vol, container = await read_at_once(
            before_start, self.current_data_root_id, lambda: self.checked_image(self.config.image),
            (lambda: self.engine.inspect_volume(volume)) if volume is not None else None,
            lambda: self.engine.inspect(rec.container_id))
        mark("engine_reads")
        first.get()  # its failure is the caller's, raised before any check's
        self._judge_root(rec, root.get())
        current = image.get()  # ImageRefused: nothing is judged lost
        if rec.volume_name is None:
            return self._replaced(await migrate(self, rec, current, before_replace), current)
        try:
            seen_volume = vol.get()
        except NotFound:
            seen_volume = None
        judge_volume(rec, self.identity_labels(rec.user_id, rec.chat_id, rec.data_root_id), seen_volume)
        try:
            info = container.get()
        except NotFound:
            # The volume holds the native state: a new container on it, each member RESTORED
            # through its CLI's own resume handshake.
            return self._replaced(await replace(self, rec, current, None, Replaced.RECREATED, before_replace), current)
        self.check_identity(rec, info)
        check_mount(rec, info)
        if rec.stop_reason == DISK_QUOTA:
            await self.disk.recheck(rec)  # kept stopped (SandboxRefused) until under the bound
        if info.image_id != current.id:
            return self._replaced(await replace(self, rec, current, info, Replaced.UPGRADED, before_replace), current)
        unsealed = self.unsealed(rec, info)
        if unsealed:
            log.info("sandbox.unsealed", container=rec.container_name, detail=unsealed)
            return self._replaced(await replace(self, rec, current, info, Replaced.RESEALED, before_replace), current)
        started = False
        if not info.running:
            info = await self._start_checked(rec, info.id)
            started = True
        elif self._marker_seen.get(info.id) != started_at(info):
            await check_marker(self.engine, rec, info.id)  # first sight of this run by this daemon
            self.saw_marker(info)
        self.integrity.put(token, Facts(info, current, rec.data_root_id, rec.volume_name))
        if started or rec.state != SandboxState.RUNNING:
            # the record says running again; a running one's last use is written with the turn's commit
            await self.store.touch_sandbox(rec.user_id, rec.chat_id)
            mark("sandbox_touched")
        rec = rec.model_copy(update={"state": SandboxState.RUNNING, "last_used_at": now()})
        return Sandbox(record=rec, container=info, image=current, started=started)

    @staticmethod
    def _replaced(done: Replacement, image: ImageInfo) -> Sandbox:
        return Sandbox(record=done.record, container=done.container, image=image, started=True, replaced=done.why,
                       replaced_image_id=done.replaced_image_id)

    @staticmethod
    def _judge_root(rec: SandboxRecord, current_root: str | None) -> None:
        if current_root != rec.data_root_id:
            raise SandboxLost(LostReason.DATA_ROOT_CHANGED,
                              f"created in data root {rec.data_root_id[:12]}, engine now has "
                              f"{(current_root or 'none')[:12]}")

    # -- start and remove ------------------------------------------------------------------------

    async def _start_checked(self, rec: SandboxRecord, container_id: str) -> ContainerInfo:
        """Start a stopped container, its model gate up, and check its volume's marker from the
        gate's listening line: the gate is the container's command and read the marker before
        anything else ran in this start. A wrong marker stops the container again and is
        raised: nothing ran in it but its model gate, and no CLI is ever launched on a volume
        that is not the chat's.

        The marker used to be read through the archive API beside the start; that call holds
        the container while the engine starts it (start + inspect 233 against 177 ms, issue 16).
        It is still how the marker is read when the gate's line cannot say (a gate started
        without ``--marker``) or the start failed: a marker problem is raised over a failed
        start or a gate that did not come up."""
        t = time.time()
        info: ContainerInfo | None = None
        report: GateReport | None = None
        failure: Exception | None = None
        try:
            await self.engine.start(container_id)
            mark("engine_started")
            info = await self.engine.inspect(container_id)
            self.saw_marker(info)
            log.info("sandbox.started", container=rec.container_name)
            report = await self.gate_ready(info, t)
            mark("gate_ready")
        except Exception as exc:  # the marker's verdict comes first
            failure = exc
        try:
            if report is not None and report.carries_marker:
                judge_marker(rec, report.marker)
            else:
                await check_marker(self.engine, rec, container_id)
        except SandboxLost:
            with anyio.CancelScope(shield=True):
                try:
                    await self.engine.stop(container_id)
                except Exception as exc:  # noqa: BLE001 - the verdict stands; the container is LOST either way
                    log.warning("sandbox.stop_after_marker_failed", container=rec.container_name, error=repr(exc))
            raise
        if failure is not None:
            raise failure
        assert info is not None
        return info

    async def destroy(self, user_id: str, chat_id: str) -> bool:
        """:meth:`remove` under the chat's lock (no resolve of this chat recreates the container
        meanwhile; the caller retires its residents first): the native state goes for good.
        The record is left to the caller. True when a container or the volume was removed."""
        lock = self._chat_lock(user_id, chat_id)
        async with lock:
            removed = await self.remove(user_id, chat_id)
        if not lock.locked() and lock.statistics().tasks_waiting == 0:
            # the chat is gone: its lock goes too (SPEC 13: state maps are pruned). Nobody holds
            # or waits for it; a later resolve of the same ids gets a fresh one
            self._chat_locks.pop((user_id, chat_id), None)
        return removed.container or removed.volume

    async def remove_volume(self, user_id: str, chat_id: str, rec: SandboxRecord | None = None) -> bool:
        """Remove the chat's state volume: the recorded one, else the one its name derives to
        (a record lost, or a migration interrupted). The engine refuses a volume a container
        still mounts: remove the container first. True when a volume was removed."""
        if rec is None:
            rec = await self.store.get_sandbox(user_id, chat_id)
        name = (rec.volume_name if rec is not None else None) or volume_name(container_name(user_id, chat_id))
        try:
            await self.engine.remove_volume(name)
        except NotFound:
            return False
        log.info("sandbox.volume_removed", volume=name)
        return True

    async def expire(self, user_id: str, chat_id: str, reason: str) -> bool:
        """Retention: remove the container and the chat's state volume (the native state goes
        with them) and record the sandbox LOST with ``reason``; idempotent."""
        rec = await self.store.get_sandbox(user_id, chat_id)
        if rec is None or rec.state == SandboxState.LOST:
            return False
        await self.destroy(user_id, chat_id)
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
        """Idle-stop: the container stops (its state volume and writable layer are kept)."""
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
        name = container_name(user_id, chat_id)
        refs = (rec.container_id if rec else None, name, f"{name}{ASIDE_SUFFIX}")  # + a migration's leftover
        for ref in dict.fromkeys(r for r in refs if r):
            try:
                await self.engine.remove(ref)  # force: a running container and its processes end here
                container = True
            except NotFound:
                pass
        if rec is not None:
            self._marker_seen.pop(rec.container_id, None)
        volume = await self.remove_volume(user_id, chat_id, rec)
        if rec is not None:
            self.integrity.forget(rec.container_id)
            self._changed(user_id, chat_id, SandboxState.LOST)  # the capacity's room: it runs no more
        if self.config.socket_root is not None:
            sockets = self.socket_dir(user_id, chat_id)
            await anyio.to_thread.run_sync(lambda: shutil.rmtree(sockets, ignore_errors=True))
        log.info("sandbox.removed", container=container_name(user_id, chat_id), removed=container, volume=volume)
        return Removal(container=container, volume=volume)

