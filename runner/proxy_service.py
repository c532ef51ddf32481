"""``python -m runner.proxy_service``: the model proxy in a process of its own (SPEC 12, 14).

The daemon starts it (``runner.proxy_client``) with its configuration on stdin; it detaches
(a new session, not the daemon's child), so neither the daemon's SIGTERM nor its ``kill -9``
ends it: a reply streaming to a sandbox when the daemon dies reaches its CLI whole, and the
next daemon attaches to the same service. It holds ``HOME/proxy/service.lock`` while it lives
(one service per home), writes its pid beside it and logs JSON lines to
``HOME/proxy/service.log`` (rotated past 64 MiB). ``--foreground`` keeps it attached, its
output left to whoever started it (a process manager).
"""

from __future__ import annotations

import argparse
import fcntl
import os
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import anyio
import structlog
from prometheus_client import CollectorRegistry

from runner import event_loop, heap
from runner.model_proxy import ModelProxy
from runner.proxy_control import ControlServer
from runner.proxy_protocol import ServiceConfig, ServicePaths, build_id
from state.backends import open_store
from telemetry.gc_pauses import PROXY_SERVICE, GcPauses
from telemetry.logs import configure_logging

log = structlog.get_logger("proxy_service")

EXIT_ALREADY_RUNNING = 3
LOCK_WAIT_S = 30.0  # a replaced service may still be closing its sandboxes
LOG_KEEP_BYTES = 64 << 20  # past this the log is rotated (one old generation, service.log.1)
LOG_CHECK_S = 60.0


def rotate_log(path: Path, fds: tuple[int, ...], limit: int = LOG_KEEP_BYTES) -> bool:
    """When the log at ``path`` — the file ``fds`` write to — is over ``limit``: move it to
    ``<path>.1`` and point ``fds`` at a new file. Blocking."""
    try:
        on_disk = path.stat()
    except FileNotFoundError:
        return False
    ours = all((os.fstat(fd).st_dev, os.fstat(fd).st_ino) == (on_disk.st_dev, on_disk.st_ino) for fd in fds)
    if not fds or not ours or on_disk.st_size <= limit:
        return False  # e.g. --foreground under a process manager: its output is not ours to move
    path.replace(path.with_name(path.name + ".1"))
    fresh = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    for fd in fds:
        os.dup2(fresh, fd)
    os.close(fresh)
    return True


async def keep_log_bounded(path: Path, fds: tuple[int, ...]) -> None:
    while True:
        if await anyio.to_thread.run_sync(rotate_log, path, fds):
            log.info("proxy_service.log_rotated", previous=str(path.with_name(path.name + ".1")))
        await anyio.sleep(LOG_CHECK_S)


async def run_service(config: ServiceConfig, *, log_fds: tuple[int, ...] = (),
                      on_ready: Callable[[CollectorRegistry], None] | None = None) -> str:
    """Serve until stopped; returns why. ``log_fds`` write to the service's log, which is
    kept under ``LOG_KEEP_BYTES``; ``on_ready``: called once its proxy is up, with the
    registry the daemon's /metrics relays (``main``: runner.heap, telemetry.gc_pauses)."""
    build = await anyio.to_thread.run_sync(build_id)
    # its writes are the wire records, made durable by the receipt commit that follows them
    store = open_store(config.store_url.get_secret_value() if config.store_url else None, config.store_path,
                       sync_commits=False)
    await store.open()
    registry = CollectorRegistry()  # the proxy's counters; the daemon's /metrics relays them
    try:
        async with ModelProxy(config.proxy, store, registry=registry) as proxy, anyio.create_task_group() as tg:
            tg.start_soon(keep_log_bounded, config.paths.log, log_fds)
            if on_ready is not None:
                on_ready(registry)
            reason = await ControlServer(config, proxy, build_id=build, registry=registry).serve()
            tg.cancel_scope.cancel()
            return reason
    finally:
        with anyio.CancelScope(shield=True):
            await store.aclose()


def take_lock(path: Path, wait_s: float) -> int | None:
    """An exclusive flock on ``path`` (its fd, held until the process exits), or None when
    another service still holds it after ``wait_s``."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.05)


def detach() -> bool:
    """Fork: True in the parent (which exits at once), False in the service, which leads a
    session of its own and reads nothing from the daemon any more."""
    if os.fork() > 0:
        return True
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m runner.proxy_service", description=__doc__)
    parser.add_argument("--home", required=True, help="CLOUD_AGENT_HOME of the daemon (names the process)")
    parser.add_argument("--foreground", action="store_true", help="do not detach")
    args = parser.parse_args(argv)
    config = ServiceConfig.model_validate_json(sys.stdin.buffer.read())
    if config.home != Path(args.home):
        parser.error(f"--home {args.home} is not the configuration's home {config.home}")
    paths: ServicePaths = config.paths
    paths.check()
    paths.prepare()
    if not args.foreground and detach():
        return 0
    configure_logging(json=True)
    lock = take_lock(paths.lock, LOCK_WAIT_S)
    if lock is None:
        log.warning("proxy_service.already_running", lock=str(paths.lock))
        return EXIT_ALREADY_RUNNING
    try:
        paths.pid.write_text(f"{os.getpid()}\n")
        log.info("proxy_service.started", pid=os.getpid(), home=str(config.home))
        def ready(registry: CollectorRegistry) -> None:
            log.info("proxy_service.heap_frozen", objects=heap.freeze_startup())
            GcPauses(registry, PROXY_SERVICE).install()  # its collections from now on, relayed

        reason = event_loop.run(partial(run_service, config, log_fds=() if args.foreground else (1, 2),
                                        on_ready=ready))
        log.info("proxy_service.stopped", reason=reason)
        return 0
    except Exception:
        log.exception("proxy_service.crashed")
        return 1
    finally:
        paths.pid.unlink(missing_ok=True)
        # the lock stays held until the process is gone (the kernel drops it at exit): a free
        # lock means no service of this home runs any more


if __name__ == "__main__":
    sys.exit(main())
