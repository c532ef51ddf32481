"""The proxy service's control socket: answers the daemon's requests (``runner.proxy_protocol``)
with the :class:`~runner.model_proxy.ModelProxy` it runs, and decides when the service ends —
an explicit ``stop``, SIGTERM/SIGINT, or ``linger_s`` with no daemon connected and no exchange
in flight. A daemon that goes away (restart, ``kill -9``) ends nothing: exchanges in flight
stream on and each member's running turn stays known for the next daemon.
"""

from __future__ import annotations

import os
import signal
import time
from datetime import UTC, datetime
from typing import Any

import anyio
import structlog
from anyio.abc import TaskGroup
from anyio.streams.buffered import BufferedByteReceiveStream
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from proxy.sockets import SocketStream, UnixListener
from runner.model_proxy import ModelProxy
from runner.proxy_protocol import (
    AnswerLine,
    Begin,
    Close,
    End,
    FamilySnapshot,
    Flush,
    Hello,
    HelloResult,
    KeepTurns,
    Member,
    Metrics,
    MetricsResult,
    Open,
    OpenResult,
    Request,
    RequestLine,
    SampleSnapshot,
    ServiceConfig,
    Stop,
    encode,
    parse_request,
    read_line,
)

log = structlog.get_logger("proxy_service")

_GONE = (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError)


def snapshot(registry: CollectorRegistry) -> MetricsResult:
    """The registry's samples as they are now, for the daemon's /metrics."""
    return MetricsResult(families=[
        FamilySnapshot(name=m.name, documentation=m.documentation, type=m.type, unit=m.unit,
                       samples=[SampleSnapshot(name=s.name, labels=s.labels, value=s.value, timestamp=s.timestamp)
                                for s in m.samples])
        for m in registry.collect()])


class ControlServer:
    def __init__(self, config: ServiceConfig, proxy: ModelProxy, *, build_id: str,
                 registry: CollectorRegistry) -> None:
        self.config, self.proxy, self.build_id, self.registry = config, proxy, build_id, registry
        self.started_at = datetime.now(UTC)
        self.daemons = 0  # connections that said hello as a daemon and are still open
        self._stopping = anyio.Event()
        self._reason = ""
        self._drain_s = 0.0

    def stop(self, reason: str, drain_s: float = 0.0) -> None:
        if not self._stopping.is_set():
            self._reason, self._drain_s = reason, drain_s
            self._stopping.set()

    async def serve(self) -> str:
        """Serve until stopped; returns why (``stop``, ``linger``, ``signal``). The control
        socket is gone before exchanges in flight drain, so a new daemon meets no dying service."""
        paths = self.config.paths

        def listen() -> UnixListener:
            paths.prepare()
            return UnixListener(paths.control, 0o600)

        listener = await anyio.to_thread.run_sync(listen)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._accept, listener, tg)
                tg.start_soon(self._linger)
                tg.start_soon(self._signals)
                log.info("proxy_service.listening", control=str(paths.control), pid=os.getpid(),
                         build_id=self.build_id, linger_s=self.config.linger_s)
                await self._stopping.wait()
                tg.cancel_scope.cancel()
        finally:
            listener.close()
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(lambda: paths.control.unlink(missing_ok=True))
        with anyio.move_on_after(self._drain_s):
            while self.proxy.in_flight():
                await anyio.sleep(0.05)
        return self._reason

    # -- lifecycle ------------------------------------------------------------------------------

    async def _linger(self) -> None:
        linger_s = self.config.linger_s
        idle_since: float | None = None
        while True:
            if self.daemons == 0 and self.proxy.in_flight() == 0:
                idle_since = idle_since if idle_since is not None else time.monotonic()
                if time.monotonic() - idle_since >= linger_s:
                    log.info("proxy_service.lingered_out", linger_s=linger_s)
                    self.stop("linger")
                    return
            else:
                idle_since = None
            await anyio.sleep(min(1.0, linger_s / 4))

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for signum in signals:
                log.info("proxy_service.signalled", signal=signal.Signals(signum).name)
                self.stop("signal")
                return

    # -- connections ----------------------------------------------------------------------------

    async def _accept(self, listener: UnixListener, tg: TaskGroup) -> None:
        while True:
            try:
                stream = await listener.accept()
            except OSError as exc:  # EMFILE and friends: back off, keep the socket
                log.warning("proxy_service.accept_failed", error=str(exc))
                await anyio.sleep(0.1)
                continue
            tg.start_soon(self._connection, stream)

    async def _connection(self, stream: SocketStream) -> None:
        buffered = BufferedByteReceiveStream(stream)
        write = anyio.Lock(fast_acquire=True)
        daemon = False
        try:
            # requests are answered concurrently (a flush waits while other turns begin and
            # end); once the peer is gone the requests it sent still complete (an open half
            # done would leave a socket nobody knows of), their answers dropped
            async with anyio.create_task_group() as tg:
                while True:
                    try:
                        line = parse_request(await read_line(buffered))
                    except _GONE:
                        break
                    except (anyio.DelimiterNotFound, ValidationError) as exc:
                        log.warning("proxy_service.bad_request", error=str(exc)[:200])
                        break
                    if isinstance(line.request, Hello) and line.request.role == "daemon" and not daemon:
                        daemon = True
                        self.daemons += 1
                        log.info("proxy_service.daemon_attached", daemons=self.daemons)
                    if self._at_once(line.request):
                        await self._answer(stream, write, line)
                    else:
                        tg.start_soon(self._answer, stream, write, line)
        finally:
            if daemon:
                self.daemons -= 1
                log.info("proxy_service.daemon_detached", daemons=self.daemons)
            await stream.aclose()

    def _at_once(self, request: Request) -> bool:
        """Answered without waiting for anything, so without a task of its own: a turn's begin
        and its flush (once its chat is quiet) are on the turn's path, and a task per request
        was a trip round this loop for each (issue 16). Requests that may wait still get one:
        a flush of a busy chat must not hold up the requests behind it."""
        if isinstance(request, Flush):
            return self.proxy.quiet(request.chat_key)
        return isinstance(request, (Begin, End, Member, KeepTurns, Hello))

    async def _answer(self, stream: SocketStream, write: anyio.Lock, line: RequestLine) -> None:
        try:
            answer = AnswerLine(id=line.id, ok=True, result=await self._dispatch(line.request))
        except Exception as exc:  # noqa: BLE001 - the daemon gets the error; the service serves on
            log.warning("proxy_service.request_failed", op=line.request.op, error=repr(exc))
            answer = AnswerLine(id=line.id, ok=False, error=f"{type(exc).__name__}: {exc}")
        async with write:
            try:
                await stream.send(encode(answer))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass
        if isinstance(line.request, Stop):  # answered first: the caller learns it was heard
            log.info("proxy_service.stop_requested", drain_s=line.request.drain_s)
            self.stop("stop", line.request.drain_s)

    async def _dispatch(self, request: Request) -> dict[str, Any]:
        proxy = self.proxy
        match request:
            case Hello():
                hello = HelloResult(pid=os.getpid(), started_at=self.started_at, build_id=self.build_id,
                                    config_digest=self.config.digest(), daemons=self.daemons,
                                    in_flight=proxy.in_flight(), sandboxes=proxy.open_sandboxes())
                return hello.model_dump(mode="json")
            case Open():
                path = await proxy.open(request.chat_key, request.user_id, request.chat_id, request.directory)
                return OpenResult(path=path).model_dump(mode="json")
            case Close():
                await proxy.close(request.chat_key)
            case Flush():
                await proxy.flush(request.chat_key, request.timeout_s, request.end_of)
            case Member():
                await proxy.member(request.chat_key, request.member_key, request.member_id)
            case Begin():
                await proxy.begin(request.chat_key, request.member_key, request.member_id, request.job_id)
            case End():
                await proxy.end(request.chat_key, request.member_key, request.job_id)
            case KeepTurns():
                await proxy.keep_turns(request.job_ids)
            case Metrics():
                return snapshot(self.registry).model_dump(mode="json")
            case Stop():
                pass
        return {}
