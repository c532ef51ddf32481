"""The container engine seam (SPEC section 11).

Every engine call the sandbox manager makes goes through :class:`Engine`, so a
Kubernetes backend could replace Docker without touching the runner or the drivers.
:class:`DockerEngine` implements it with the Docker SDK; its blocking calls run in worker
threads so the daemon's event loop never waits on the engine.
"""

from __future__ import annotations

import io
import tarfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, Protocol

import anyio
import docker
import docker.errors
import structlog

from sandbox_manager.engine_errors import Conflict, EngineError, NotFound
from sandbox_manager.engine_reads import EngineReads
from sandbox_manager.engine_types import (
    ContainerInfo,
    ContainerSpec,
    FileEntry,
    ImageInfo,
    Mount,
    VolumeInfo,
    container_info,
    rfc3339_ns,
)
from sandbox_manager.exec_stream import ExecStream

log = structlog.get_logger("engine")

DATA_ROOT_VOLUME = "cloud-agent-dataroot-identity"
DATA_ROOT_LABEL = "org.cloud-agent.dataroot-id"
AGENT_UID = 1000
AGENT_HOME = "/home/agent"


class Engine(Protocol):
    async def ping(self) -> bool: ...
    async def version(self) -> dict[str, Any]: ...
    async def data_root_identity(self, *, create: bool) -> str | None: ...
    async def image(self, ref: str) -> ImageInfo: ...
    async def create(self, spec: ContainerSpec) -> ContainerInfo: ...
    async def inspect(self, container_id: str) -> ContainerInfo: ...
    async def start(self, container_id: str) -> None: ...
    async def stop(self, container_id: str, timeout_s: int = 5) -> None: ...
    async def remove(self, container_id: str) -> None: ...
    async def list_labelled(self, label: str) -> list[ContainerInfo]: ...
    async def exec_run(self, container_id: str, argv: list[str], *, user: str = "agent",
                       env: dict[str, str] | None = None, workdir: str | None = None) -> tuple[int, bytes]: ...
    async def exec_attached(self, container_id: str, argv: list[str], *, user: str = "agent",
                            env: dict[str, str] | None = None, workdir: str | None = None) -> ExecStream: ...
    async def exec_exit_code(self, exec_id: str) -> int | None: ...
    async def wait_log_line(self, container_id: str, needle: str, *, since: float, timeout_s: float) -> str | None: ...
    async def put_files(self, container_id: str, files: list[FileEntry], dirs: list[str]) -> None: ...
    def follow_events(self, filters: dict[str, list[str]]) -> Any: ...
    async def rename(self, container_id: str, name: str) -> None: ...
    async def create_volume(self, name: str, labels: dict[str, str]) -> VolumeInfo: ...
    async def inspect_volume(self, name: str) -> VolumeInfo: ...
    async def remove_volume(self, name: str) -> None: ...
    async def list_volumes(self, label: str) -> list[VolumeInfo]: ...
    async def read_file(self, container_id: str, path: str) -> bytes: ...
    async def put_root_file(self, container_id: str, path: str, content: bytes, mode: int = 0o444) -> None: ...
    async def copy_tree(self, src_container: str, path: str, dst_container: str) -> None: ...


def _logged_after(line: bytes, since: float) -> bool:
    """A ``timestamps=True`` log line (RFC 3339, nanoseconds) written at or after ``since``."""
    t = rfc3339_ns(line.split(b" ", 1)[0].decode(errors="replace"))
    return t is not None and t / 1e9 >= since


def _tar(files: list[FileEntry], dirs: list[str]) -> bytes:
    buf = io.BytesIO()
    now = time.time()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        seen: set[str] = set()
        for d in dirs + [f.path.rsplit("/", 1)[0] for f in files]:
            parts = d.strip("/").split("/")
            # every parent of a member dir below /home/agent must belong to agent
            for i in range(3, len(parts) + 1):
                p = "/".join(parts[:i])
                if p in seen:
                    continue
                seen.add(p)
                ti = tarfile.TarInfo(p)
                ti.type, ti.mode, ti.uid, ti.gid, ti.mtime = tarfile.DIRTYPE, 0o755, AGENT_UID, AGENT_UID, now
                tar.addfile(ti)
        for f in files:
            ti = tarfile.TarInfo(f.path.lstrip("/"))
            ti.size, ti.mode, ti.uid, ti.gid, ti.mtime = len(f.content), f.mode, AGENT_UID, AGENT_UID, now
            tar.addfile(ti, io.BytesIO(f.content))
    return buf.getvalue()


class DockerEngine:
    """The Docker implementation of :class:`Engine`."""

    def __init__(self, base_url: str = "unix:///var/run/docker.sock", timeout_s: int = 120) -> None:
        self.base_url = base_url
        self._timeout_s = timeout_s
        # The SDK client negotiates the API version over the socket when it is made, so it is
        # made lazily, by the first call, in a worker thread: constructing the engine is cheap
        # and never blocks an event loop (nor fails when the engine is down; ping says so).
        self._client: docker.DockerClient | None = None
        self._client_lock = threading.Lock()
        # SDK calls are blocking; a bounded pool keeps a burst of turns from starving the engine.
        self._limiter = anyio.CapacityLimiter(16)
        self._reads: EngineReads | None = None  # made with the client (it needs the API version)

    @property
    def client(self) -> docker.DockerClient:
        """The SDK client (blocking on first use: call it only from worker threads)."""
        with self._client_lock:
            if self._client is None:
                self._client = docker.DockerClient(base_url=self.base_url, timeout=self._timeout_s)
            return self._client

    @property
    def api(self) -> Any:
        return self.client.api

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Run ``fn(sdk_client, *args, **kwargs)`` in a worker thread, mapping SDK errors."""

        def run() -> Any:
            try:
                return fn(self.client, *args, **kwargs)
            except docker.errors.NotFound as exc:
                raise NotFound(str(exc)) from exc
            except docker.errors.APIError as exc:
                raise (Conflict if exc.status_code == 409 else EngineError)(str(exc)) from exc
            except docker.errors.DockerException as exc:
                raise EngineError(str(exc)) from exc

        return await anyio.to_thread.run_sync(run, limiter=self._limiter)

    async def _read(self, read: Callable[[EngineReads], dict[str, Any]],
                    sdk: Callable[[docker.DockerClient], dict[str, Any]]) -> dict[str, Any]:
        """An inspect's JSON in a worker thread: on the engine's unix socket straight
        (sandbox_manager.engine_reads: half the SDK's cost), else through the SDK."""
        if not self.base_url.startswith("unix://"):
            return await self._call(sdk)

        def run() -> dict[str, Any]:
            if self._reads is None:
                self._reads = EngineReads(self.base_url.removeprefix("unix://"), self.client.api.api_version,
                                          self._timeout_s)
            return read(self._reads)

        return await anyio.to_thread.run_sync(run, limiter=self._limiter)

    async def ping(self) -> bool:
        try:
            return bool(await self._call(lambda c: c.api.ping()))
        except (EngineError, OSError):
            return False

    async def version(self) -> dict[str, Any]:
        return await self._call(lambda c: c.api.version())

    async def data_root_identity(self, *, create: bool) -> str | None:
        """An id that lives inside the engine's data root (a labelled marker volume).

        A different data root (or a wiped one) has no marker or another id, which is how
        the sandbox manager tells that retained native state cannot be there.
        """
        try:
            vol = await self._read(lambda r: r.volume(DATA_ROOT_VOLUME), lambda c: c.api.inspect_volume(DATA_ROOT_VOLUME))
            return (vol.get("Labels") or {}).get(DATA_ROOT_LABEL)
        except NotFound:
            if not create:
                return None
        ident = uuid.uuid4().hex
        try:
            await self._call(lambda c: c.volumes.create(name=DATA_ROOT_VOLUME, labels={DATA_ROOT_LABEL: ident}))
        except EngineError:
            pass  # created concurrently: read back whichever won
        vol = await self._read(lambda r: r.volume(DATA_ROOT_VOLUME), lambda c: c.api.inspect_volume(DATA_ROOT_VOLUME))
        return (vol.get("Labels") or {}).get(DATA_ROOT_LABEL)

    async def image(self, ref: str) -> ImageInfo:
        attrs = await self._read(lambda r: r.image(ref), lambda c: c.api.inspect_image(ref))
        return ImageInfo(id=attrs["Id"], labels=dict((attrs.get("Config") or {}).get("Labels") or {}),
                         tags=tuple(t for t in attrs.get("RepoTags") or [] if t != "<none>:<none>"))

    async def create(self, spec: ContainerSpec) -> ContainerInfo:
        def run(client: docker.DockerClient) -> ContainerInfo:
            c = client.containers.create(
                image=spec.image, name=spec.name, command=list(spec.command), labels=spec.labels,
                init=True,  # PID 1 reaps: killed CLIs must not pile up as zombies
                user=spec.user, working_dir=spec.workdir, network_mode="none",  # sealed (SPEC 7): there is no other setting
                cap_drop=["ALL"], security_opt=["no-new-privileges"], privileged=False,
                # swap equal to memory: no swap beyond the limit (the engine's default doubles it)
                mem_limit=spec.memory_bytes, memswap_limit=spec.memory_bytes,
                pids_limit=spec.pids_limit, nano_cpus=spec.nano_cpus,
                detach=True, tty=False, stdin_open=False,
                volumes={**{m.source: {"bind": m.target, "mode": "ro" if m.read_only else "rw"} for m in spec.mounts},
                         **({spec.home_volume: {"bind": AGENT_HOME, "mode": "rw"}} if spec.home_volume else {})},
                **({"storage_opt": {"size": str(spec.disk_bytes)}} if spec.disk_bytes else {}),
            )
            return container_info(c.attrs)  # the SDK's create inspects what it made: no second inspect

        return await self._call(run)

    async def inspect(self, container_id: str) -> ContainerInfo:
        return container_info(await self._read(lambda r: r.container(container_id),
                                               lambda c: c.api.inspect_container(container_id)))

    async def start(self, container_id: str) -> None:
        await self._call(lambda c: c.api.start(container_id))

    async def stop(self, container_id: str, timeout_s: int = 5) -> None:
        await self._call(lambda c: c.api.stop(container_id, timeout=timeout_s))

    async def remove(self, container_id: str) -> None:
        await self._call(lambda c: c.api.remove_container(container_id, force=True))

    async def list_labelled(self, label: str) -> list[ContainerInfo]:
        def run(client: docker.DockerClient) -> list[ContainerInfo]:
            out = []
            for row in client.api.containers(all=True, filters={"label": label}):
                try:  # a container removed between the listing and its inspect is simply gone
                    out.append(container_info(client.containers.get(row["Id"]).attrs))
                except docker.errors.NotFound:
                    continue
            return out

        return await self._call(run)

    async def exec_run(self, container_id: str, argv: list[str], *, user: str = "agent",
                       env: dict[str, str] | None = None, workdir: str | None = None) -> tuple[int, bytes]:
        def run(client: docker.DockerClient) -> tuple[int, bytes]:
            ex = client.api.exec_create(container_id, argv, stdout=True, stderr=True, user=user,
                                        environment=env, workdir=workdir)
            out = client.api.exec_start(ex["Id"])
            code = client.api.exec_inspect(ex["Id"]).get("ExitCode")
            return (code if code is not None else -1), out

        return await self._call(run)

    async def exec_attached(self, container_id: str, argv: list[str], *, user: str = "agent",
                            env: dict[str, str] | None = None, workdir: str | None = None) -> ExecStream:
        def run(client: docker.DockerClient) -> tuple[str, Any]:
            ex = client.api.exec_create(container_id, argv, stdin=True, stdout=True, stderr=True, tty=False,
                                        user=user, environment=env, workdir=workdir)
            sock = client.api.exec_start(ex["Id"], socket=True, tty=False)
            return ex["Id"], sock

        exec_id, sock = await self._call(run)
        raw = getattr(sock, "_sock", sock)
        if raw is not sock:
            # The SDK hands back a file object (SocketIO) on the socket; while it holds its
            # reference, closing ``raw`` leaves the fd open until the garbage collector runs,
            # so dockerd never sees us hang up (the exec's stdin stays open). Drop it now.
            sock.close()
        return await ExecStream.from_socket(raw, exec_id)

    async def exec_exit_code(self, exec_id: str) -> int | None:
        info = await self._call(lambda c: c.api.exec_inspect(exec_id))
        return None if info.get("Running") else info.get("ExitCode")

    async def wait_log_line(self, container_id: str, needle: str, *, since: float, timeout_s: float) -> str | None:
        """Follow the container's own output (its command's, since ``since``, a Unix time) until a
        line holds ``needle``: that line, without its timestamp; None after ``timeout_s`` or when
        the output ends (the container stopped). A cancel scope bounds the wait.

        One followed log stream, read by a worker thread that only reads: the line arrives as
        the engine has it. Polling every 10 ms, as before, found it 5 ms late on average and
        made a short engine call per poll (issue 16). Leaving closes the stream, which ends a
        read still waiting (abandoned on a timeout or a cancel)."""
        stream = await self._call(lambda c: c.api.logs(container_id, stdout=True, stderr=True, since=int(since),
                                                       timestamps=True, stream=True, follow=True))
        chunks = iter(stream)

        def read_one() -> bytes | None:
            try:
                return next(chunks, None)
            except Exception:  # noqa: BLE001 - closed under us, or the engine went away: the end
                return None

        pending, wanted = b"", needle.encode()
        try:
            with anyio.move_on_after(timeout_s):
                while (chunk := await anyio.to_thread.run_sync(read_one, abandon_on_cancel=True)) is not None:
                    *lines, pending = (pending + chunk).split(b"\n")
                    for line in lines:
                        if wanted in line and _logged_after(line, since):
                            return line.split(b" ", 1)[-1].decode(errors="replace")
            return None
        finally:
            stream.close()

    async def put_files(self, container_id: str, files: list[FileEntry], dirs: list[str]) -> None:
        data = _tar(files, dirs)
        ok = await self._call(lambda c: c.api.put_archive(container_id, "/", data))
        if not ok:
            raise EngineError(f"put_archive into {container_id[:12]} failed")

    @asynccontextmanager
    async def follow_events(self, filters: dict[str, list[str]]) -> AsyncIterator[Any]:
        """The engine's event stream, connected when this is entered: an async iterator of event
        dicts that ends when the engine closes the stream. Each event is pulled by one worker
        thread that only reads and returns: it never calls back into the event loop, so a read
        that wakes after the loop has stopped (leaving the block closes the stream, which ends
        the read) finishes on its own instead of waiting for ever on a loop that is gone — a
        worker waiting so kept the process from exiting."""
        stream = await self._call(lambda c: c.api.events(decode=True, filters=filters))
        reader = iter(stream)
        one_reader = anyio.CapacityLimiter(1)

        def read_one() -> dict[str, Any] | None:
            try:
                return next(reader, None)
            except Exception:  # noqa: BLE001 - closed under us, the engine went away: the end
                return None

        async def events() -> AsyncIterator[dict[str, Any]]:
            while (event := await anyio.to_thread.run_sync(
                    read_one, abandon_on_cancel=True, limiter=one_reader)) is not None:
                yield event

        iterator = events()
        try:
            yield iterator
        finally:
            stream.close()
            await iterator.aclose()

    async def rename(self, container_id: str, name: str) -> None:
        await self._call(lambda c: c.api.rename(container_id, name))

    # -- volumes and archives (state volumes, SPEC 15) ---------------------------------------

    @staticmethod
    def _volume(attrs: dict[str, Any]) -> VolumeInfo:
        return VolumeInfo(name=attrs["Name"], labels=dict(attrs.get("Labels") or {}),
                          mountpoint=attrs.get("Mountpoint"))

    async def create_volume(self, name: str, labels: dict[str, str]) -> VolumeInfo:
        """Create a named volume. The engine answers an existing name with the existing
        volume unchanged: callers compare the labels they get back."""
        return self._volume(await self._call(lambda c: c.api.create_volume(name, labels=labels)))

    async def inspect_volume(self, name: str) -> VolumeInfo:
        return self._volume(await self._read(lambda r: r.volume(name), lambda c: c.api.inspect_volume(name)))

    async def remove_volume(self, name: str) -> None:
        await self._call(lambda c: c.api.remove_volume(name))

    async def list_volumes(self, label: str) -> list[VolumeInfo]:
        out = await self._call(lambda c: c.api.volumes(filters={"label": label}))
        return [self._volume(v) for v in (out or {}).get("Volumes") or []]

    async def read_file(self, container_id: str, path: str) -> bytes:
        """One small file, read through the archive API (no exec; the container may be stopped
        or only created). NotFound when the file is absent."""

        def run(client: docker.DockerClient) -> bytes:
            bits, _ = client.api.get_archive(container_id, path)
            with tarfile.open(fileobj=io.BytesIO(b"".join(bits))) as tar:
                member = tar.next()
                fh = tar.extractfile(member) if member is not None and member.isfile() else None
                if fh is None:
                    raise docker.errors.NotFound(f"{path} is not a regular file")
                return fh.read()

        return await self._call(run)

    async def put_root_file(self, container_id: str, path: str, content: bytes, mode: int = 0o444) -> None:
        """A file owned by root (the agent can read it, not rewrite it)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            ti = tarfile.TarInfo(path.lstrip("/"))
            ti.size, ti.mode, ti.uid, ti.gid, ti.mtime = len(content), mode, 0, 0, time.time()
            tar.addfile(ti, io.BytesIO(content))
        data = buf.getvalue()
        if not await self._call(lambda c: c.api.put_archive(container_id, "/", data)):
            raise EngineError(f"put_archive into {container_id[:12]} failed")

    async def copy_tree(self, src_container: str, path: str, dst_container: str) -> None:
        """Stream the tree at ``path`` of one container into the same place of another
        (ownership and modes kept; either may be stopped). The archive streams through in
        chunks: a large workspace is never held in memory."""
        parent = path.rstrip("/").rsplit("/", 1)[0] or "/"

        def run(client: docker.DockerClient) -> None:
            bits, _ = client.api.get_archive(src_container, path, chunk_size=1 << 20)
            if not client.api.put_archive(dst_container, parent, bits):
                raise docker.errors.APIError(f"put_archive of {path} into {dst_container[:12]} failed")

        await self._call(run)

    def close(self) -> None:
        with self._client_lock:
            if self._client is not None:
                self._client.close()
                self._client = None
