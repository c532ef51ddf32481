"""The benches' API client in a process of its own, as a host's clients are: the daemon's
figures then carry none of the client's HTTP work on the daemon's event loop.

    python tests/bench/api_client.py URL [--lean]   (the service token in CLOUD_AGENT_BENCH_TOKEN)

Reads ``{"id": N, "job": {...}}`` lines on stdin, POSTs each job (concurrently), and writes
``{"id": N, "t0": ns, "first": ns | null, "end": ns, "receipt": {...}}`` lines on stdout;
``t0``/``first``/``end`` are ``time.perf_counter_ns()`` (CLOCK_MONOTONIC on Linux: the same
clock in every process of the machine) at the send, the first event line and the receipt.
:class:`RemoteClient` is the bench side.

The client is httpx by default. ``--lean`` is an HTTP/1.1 client on asyncio's streams
(keep-alive connections, chunked NDJSON read line by line, every line parsed as httpx's is):
on this machine an httpx exchange costs ~2 ms more than the leanest client's
(``bench_hops.py``), all of it client CPU on the cores the daemon shares in a one-machine
bench, not the host's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
from anyio.abc import Process


class Reading:
    """One job's answer as its lines come: when it was sent, its first event line, its receipt."""

    def __init__(self) -> None:
        self.t0, self.first, self.receipt = time.perf_counter_ns(), None, None

    def line(self, line: str | bytes) -> None:
        if not line.strip():
            return
        if self.first is None and line[:16] in ('{"type": "event"', b'{"type": "event"'):
            self.first = time.perf_counter_ns()
        ev = json.loads(line)
        if ev.get("type") == "receipt":
            self.receipt = ev["receipt"]


# POSTs one job, handing each line of the answer to the reading
Exchange = Callable[[dict[str, Any], Reading], Awaitable[None]]


@asynccontextmanager
async def httpx_client(url: str, token: str) -> AsyncIterator[Exchange]:
    async with httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {token}"},
                                 timeout=httpx.Timeout(600, connect=10),
                                 limits=httpx.Limits(max_connections=64)) as client:
        async def exchange(job: dict[str, Any], reading: Reading) -> None:
            async with client.stream("POST", "/v1/jobs", json=job) as resp:
                async for line in resp.aiter_lines():
                    reading.line(line)

        yield exchange


@asynccontextmanager
async def lean_client(url: str, token: str) -> AsyncIterator[Exchange]:
    host, _, port = url.removeprefix("http://").partition(":")
    idle: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []

    async def exchange(job: dict[str, Any], reading: Reading) -> None:
        while idle and (idle[-1][0].at_eof() or idle[-1][1].is_closing()):
            idle.pop()[1].close()  # the server ended it while idle (uvicorn's keep-alive timeout)
        conn = idle.pop() if idle else await asyncio.open_connection(host, int(port))
        r, w = conn
        body = json.dumps(job).encode()
        w.write(b"POST /v1/jobs HTTP/1.1\r\nhost: %s\r\nauthorization: Bearer %s\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                % (host.encode(), token.encode(), len(body), body))
        head = (await r.readuntil(b"\r\n\r\n")).lower()
        if b"transfer-encoding: chunked" in head:
            pending = b""
            while size := int((await r.readline()).split(b";", 1)[0], 16):
                *lines, pending = (pending + (await r.readexactly(size + 2))[:-2]).split(b"\n")
                for line in lines:
                    reading.line(line)
            await r.readline()  # the empty trailer
            reading.line(pending)
        else:  # an answer with a length (an error, a repeat's receipt): its lines as they are
            length = int(head.split(b"content-length:", 1)[1].split(b"\r\n", 1)[0])
            for line in (await r.readexactly(length)).split(b"\n"):
                reading.line(line)
        if b"connection: close" not in head:
            idle.append(conn)
        else:
            w.close()

    try:
        yield exchange
    finally:
        for _, w in idle:
            w.close()


async def serve(client: Any) -> None:
    """Jobs from stdin, each POSTed at once through ``client`` (an :data:`Exchange` context), a
    result line each on stdout — for a failed exchange too: the bench must never wait forever."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    out = sys.stdout
    tasks: set[asyncio.Task[None]] = set()
    async with client as exchange:
        async def answered(cmd: dict[str, Any]) -> None:
            reading = Reading()
            try:
                await exchange(cmd["job"], reading)
                result = {"t0": reading.t0, "first": reading.first, "end": time.perf_counter_ns(),
                          "receipt": reading.receipt}
            except Exception as exc:
                result = {"t0": 0, "first": None, "end": 0, "receipt": None, "error": repr(exc)}
            out.write(json.dumps({"id": cmd["id"], **result}) + "\n")
            out.flush()

        while line := await reader.readline():
            task = asyncio.create_task(answered(json.loads(line)))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)


class RemoteClient:
    """The bench's handle on an ``api_client.py`` process."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self._next = 0
        self._waiting: dict[int, tuple[anyio.Event, list[dict[str, Any]]]] = {}

    @classmethod
    async def start(cls, url: str, token: str, tg: Any, *, lean: bool = False) -> RemoteClient:
        proc = await anyio.open_process([sys.executable, str(Path(__file__).resolve()), url,
                                         *(["--lean"] if lean else [])],
                                        env=dict(os.environ, CLOUD_AGENT_BENCH_TOKEN=token))
        client = cls(proc)
        tg.start_soon(client._read)
        return client

    async def _read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        async for data in self.proc.stdout:
            buf += data
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                result = json.loads(line)
                ev, box = self._waiting.pop(result["id"])
                box.append(result)
                ev.set()

    async def job(self, job: dict[str, Any]) -> dict[str, Any]:
        self._next += 1
        ev, box = anyio.Event(), []
        self._waiting[self._next] = (ev, box)
        assert self.proc.stdin is not None
        await self.proc.stdin.send((json.dumps({"id": self._next, "job": job}) + "\n").encode())
        await ev.wait()
        return box[0]

    async def aclose(self) -> None:
        assert self.proc.stdin is not None
        await self.proc.stdin.aclose()
        await self.proc.wait()


if __name__ == "__main__":
    make = lean_client if "--lean" in sys.argv[2:] else httpx_client
    asyncio.run(serve(make(sys.argv[1], os.environ["CLOUD_AGENT_BENCH_TOKEN"])))
