"""The daemon's side of the model proxy service (``runner.proxy_service``, SPEC 14).

``ensure_service`` finds the service of the daemon's home at its control socket, starts one
when none answers, and replaces one that runs another build of the service's code or another
configuration (a new gateway URL, key, store). ``ProxyServiceClient`` keeps the daemon
attached: when the connection is lost (the service died or was replaced) it attaches again and
sends the daemon's whole view (open sockets, members, running turns) before anything else.
A graceful daemon shutdown only closes its connection: the service serves on, and ends by
itself after ``CLOUD_AGENT_PROXY_LINGER_S`` with no daemon and nothing in flight.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import anyio
import structlog
from anyio.abc import TaskStatus
from pydantic import ValidationError

from runner.model_proxy import ProxyOps
from runner.proxy_link import LinkClosed, LinkOps, ProxyServiceError, linked
from runner.proxy_protocol import PROJECT_ROOT, HelloResult, MetricsResult, ServiceConfig, ServicePaths, build_id

log = structlog.get_logger("proxy_client")

T = TypeVar("T")
START_TIMEOUT_S = 30.0  # a new service answers hello within this
REPLACE_DRAIN_S = 5.0  # a replaced service's exchanges in flight get this long
LINK_WAIT_S = 30.0  # a request waits this long for a lost connection to come back
RETRY_S = 1.0


class ProxyServiceUnavailable(RuntimeError):
    """No model proxy service answers for this home."""


# -- starting, replacing, stopping ----------------------------------------------------------------


def spawn_blocking(config: ServiceConfig) -> None:
    """Start the service detached; its configuration goes on its stdin (the store URL may
    hold a password: never a command-line argument). Returns once the launcher has forked."""
    paths = config.paths
    paths.prepare()
    # the configuration comes on stdin alone: no CLOUD_AGENT_* setting of the daemon's leaks in
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOUD_AGENT_")}
    argv = [sys.executable, "-m", "runner.proxy_service", "--home", str(config.home)]
    with open(os.open(paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "ab") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, stderr=out, cwd=PROJECT_ROOT, env=env,
                                start_new_session=True)
    try:
        proc.communicate(config.to_json().encode(), timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise ProxyServiceUnavailable(f"the model proxy service's launcher hung; see {paths.log}") from None
    if proc.returncode != 0:
        raise ProxyServiceUnavailable(f"the model proxy service's launcher exited {proc.returncode}; see {paths.log}")


def lock_free(paths: ServicePaths) -> bool:
    """No service holds the home's lock (a process that exited, even a zombie, holds none)."""
    try:
        fd = os.open(paths.lock, os.O_RDWR)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


async def wait_gone(paths: ServicePaths, timeout_s: float) -> bool:
    with anyio.move_on_after(timeout_s):
        while not await anyio.to_thread.run_sync(lock_free, paths):
            await anyio.sleep(0.05)
        return True
    return False


def _log_tail(paths: ServicePaths) -> str:
    try:
        return paths.log.read_text(errors="replace")[-1500:]
    except OSError:
        return ""


async def _wait_listening(config: ServiceConfig, build: str) -> HelloResult:
    paths, digest = config.paths, config.digest()
    with anyio.move_on_after(START_TIMEOUT_S):
        while True:
            try:
                async with linked(paths.control) as link:
                    hello = await link.hello("operator")
                if (hello.build_id, hello.config_digest) == (build, digest):
                    return hello
            except (OSError, LinkClosed, TimeoutError):
                pass
            await anyio.sleep(0.05)
    tail = await anyio.to_thread.run_sync(_log_tail, paths)
    raise ProxyServiceUnavailable(f"the model proxy service did not answer within {START_TIMEOUT_S:.0f}s; "
                                  f"its log ends: {tail}")


async def ensure_service(config: ServiceConfig, build: str) -> str:
    """A service of ``build`` and this configuration answers at the home's control socket:
    ``attached`` (it already did), ``spawned`` (none did) or ``replaced`` (another did)."""
    paths = config.paths
    try:
        async with linked(paths.control) as link:
            try:
                hello: HelloResult | None = await link.hello("operator")
            except ValidationError:  # a hello this build cannot read: another build's
                hello = None
            if hello is not None and (hello.build_id, hello.config_digest) == (build, config.digest()):
                return "attached"
            log.info("proxy_service.replacing", pid=hello.pid if hello else None,
                     build_id=hello.build_id if hello else None, wanted_build_id=build,
                     config_changed=hello is not None and hello.config_digest != config.digest())
            await link.stop(REPLACE_DRAIN_S)
    except OSError:
        how = "spawned"  # nothing listens (no socket, or a dead service's file)
    except (LinkClosed, TimeoutError, ProxyServiceError) as exc:
        raise ProxyServiceUnavailable(f"the model proxy service at {paths.control} does not answer: {exc!r}") from exc
    else:
        how = "replaced"
        if not await wait_gone(paths, REPLACE_DRAIN_S + START_TIMEOUT_S):
            raise ProxyServiceUnavailable(f"the replaced model proxy service still holds {paths.lock}")
    await anyio.to_thread.run_sync(spawn_blocking, config)
    hello = await _wait_listening(config, build)
    log.info("proxy_service.started", how=how, pid=hello.pid, build_id=build)
    return how


async def service_status(paths: ServicePaths) -> HelloResult | None:
    """What the service of a home says about itself; None when none answers."""
    try:
        async with linked(paths.control) as link:
            return await link.hello("operator")
    except OSError:
        return None


async def stop_service(paths: ServicePaths, *, drain_s: float = 0.0, timeout_s: float = 30.0) -> int | None:
    """Stop the service of a home and wait until it is gone; its pid, or None when none ran."""
    try:
        async with linked(paths.control) as link:
            hello = await link.hello("operator")
            await link.stop(drain_s)
    except OSError:
        return None
    if not await wait_gone(paths, drain_s + timeout_s):
        raise ProxyServiceUnavailable(f"the model proxy service (pid {hello.pid}) did not stop")
    return hello.pid


# -- the daemon's connection ----------------------------------------------------------------------


class ProxyServiceClient:
    """:class:`runner.model_proxy.ProxyOps` over the service, for as long as ``run`` runs."""

    def __init__(self, config: ServiceConfig, *, replay: Callable[[ProxyOps], Awaitable[None]]) -> None:
        self.config = config
        self._replay = replay  # sends the daemon's view over a new connection, before any request
        self._ops: LinkOps | None = None
        self._ready = anyio.Event()  # set exactly while _ops is a live, replayed link
        self.service: HelloResult | None = None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Attach (starting the service if needed) and stay attached; ``started`` once the first
        attach is done. The first attach failing three times is the daemon's start failing."""
        build = await anyio.to_thread.run_sync(build_id)
        started, failures = False, 0
        while True:
            try:
                how = await ensure_service(self.config, build)
                async with linked(self.config.paths.control) as link:
                    hello = await link.hello("daemon")
                    if (hello.build_id, hello.config_digest) != (build, self.config.digest()):
                        raise ProxyServiceUnavailable("another model proxy service answered meanwhile")
                    ops = LinkOps(link)
                    await self._replay(ops)
                    self._ops, self.service = ops, hello
                    self._ready.set()
                    log.info("proxy_service.attached", how=how, pid=hello.pid, build_id=hello.build_id,
                             daemons=hello.daemons, in_flight=hello.in_flight, sandboxes=hello.sandboxes)
                    if not started:
                        started = True
                        task_status.started()
                    await link.closed.wait()
                    log.warning("proxy_service.connection_lost", pid=hello.pid)
            except Exception as exc:  # noqa: BLE001 - the model path stays up: attach again (a start fails)
                failures += 1
                if not started and failures >= 3:
                    raise ProxyServiceUnavailable(f"the model proxy service: {exc}") from exc
                log.warning("proxy_service.attach_failed", error=repr(exc))
            finally:
                self._ops = None
                if self._ready.is_set():
                    self._ready = anyio.Event()
            await anyio.sleep(RETRY_S)

    @property
    def link(self) -> LinkOps | None:
        """The live, replayed connection (a new object after every reconnect), or None."""
        return self._ops

    async def _call(self, fn: Callable[[LinkOps], Awaitable[T]], wait_s: float) -> T:
        for _ in range(2):  # a connection lost under the request: once more on the next one
            with anyio.move_on_after(wait_s):
                while self._ops is None:
                    await self._ready.wait()
            if self._ops is None:
                raise ProxyServiceUnavailable(f"no model proxy service answered within {wait_s:.0f}s "
                                              f"(see {self.config.paths.log})")
            try:
                return await fn(self._ops)
            except LinkClosed:
                continue
            except TimeoutError as exc:
                raise ProxyServiceUnavailable("the model proxy service did not answer in time") from exc
        raise ProxyServiceUnavailable("the connection to the model proxy service was lost twice")

    async def open(self, chat_key: str, user_id: str, chat_id: str, directory: Path) -> Path:
        return await self._call(lambda o: o.open(chat_key, user_id, chat_id, directory), LINK_WAIT_S)

    async def close(self, chat_key: str) -> None:
        await self._call(lambda o: o.close(chat_key), LINK_WAIT_S)

    async def flush(self, chat_key: str, timeout_s: float, end_of: tuple[str, str] | None = None) -> None:
        await self._call(lambda o: o.flush(chat_key, timeout_s, end_of), LINK_WAIT_S)

    async def member(self, chat_key: str, member_key: str, member_id: str) -> None:
        await self._call(lambda o: o.member(chat_key, member_key, member_id), LINK_WAIT_S)

    async def begin(self, chat_key: str, member_key: str, member_id: str, job_id: str) -> None:
        await self._call(lambda o: o.begin(chat_key, member_key, member_id, job_id), LINK_WAIT_S)

    async def end(self, chat_key: str, member_key: str, job_id: str) -> None:
        await self._call(lambda o: o.end(chat_key, member_key, job_id), LINK_WAIT_S)

    async def keep_turns(self, job_ids: list[str]) -> None:
        await self._call(lambda o: o.keep_turns(job_ids), LINK_WAIT_S)

    async def metrics(self, wait_s: float) -> MetricsResult:
        return await self._call(lambda o: o.metrics(), wait_s)
