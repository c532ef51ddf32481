"""The event loop's CPU for the daemon's two links of a turn, on anyio's streams (until stop 54)
against transports of the loop's own, side by side in one run (issue 16).

    uv run python tests/bench/bench_link_stream.py [EXCHANGES] [--lines 10] [--gap-us 200] [--blocks 6]

1. The keeper link (sandbox_manager.keeper_link.SocketBytes): a peer process plays the keeper,
   writing ``--lines`` lines of 200 bytes ``--gap-us`` apart for each input (a CLI's events
   come spaced out, so each is a read of its own). CPU per exchange: input sent, every line read.
2. The proxy service's link (runner.proxy_link.ServiceLink): a peer process answers each
   request line at once. CPU per call: the request sent, its answer matched to it.

Each pair is measured in alternated blocks; the ratio is the new one's CPU over the old one's.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
from anyio.streams.buffered import BufferedByteReceiveStream

from proxy.sockets import connect_unix
from runner import event_loop
from runner.proxy_link import ServiceLink
from runner.proxy_protocol import AnswerLine, Close, RequestLine, encode
from sandbox_manager.keeper_link import SocketBytes

LINE = b"x" * 199 + b"\n"

PEER = """
import socket, sys, time
sock = socket.socket(fileno=int(sys.argv[1]))
lines, gap = int(sys.argv[2]), float(sys.argv[3])
line = b"x" * 199 + b"\\n"
while sock.recv(100):
    for _ in range(lines):
        sock.sendall(line)
        until = time.perf_counter() + gap
        while time.perf_counter() < until:
            pass
"""


class AnyioBytes:
    """The keeper link as it was: anyio's socket stream."""

    def __init__(self, stream: anyio.abc.SocketStream) -> None:
        self.stream = stream

    @classmethod
    async def of(cls, sock: socket.socket) -> AnyioBytes:
        return cls(await anyio.abc.UNIXSocketStream.from_socket(sock))

    async def send_bytes(self, data: bytes) -> None:
        await self.stream.send(data)

    async def receive_bytes(self) -> bytes:
        return await self.stream.receive(65536)

    async def aclose(self) -> None:
        await self.stream.aclose()


SERVICE = """
import json, os, socket, sys
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
print("ready", flush=True)
conn, _ = listener.accept()
buf = b""
while chunk := conn.recv(65536):
    buf += chunk
    *lines, buf = buf.split(b"\\n")
    out = b"".join(json.dumps({"id": json.loads(line)["id"], "ok": True, "result": {}}).encode() + b"\\n"
                   for line in lines)
    conn.sendall(out)
"""


class AnyioServiceLink:
    """The proxy link as it was: anyio's buffered stream, a reader task, an event per call."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._buffered = BufferedByteReceiveStream(stream)
        self._next_id = 0
        self._waiting: dict[int, list[Any]] = {}
        self._write = anyio.Lock(fast_acquire=True)

    async def read_answers(self) -> None:
        try:
            while True:
                answer = AnswerLine.model_validate_json(await self._buffered.receive_until(b"\n", 1 << 22))
                waiting = self._waiting.pop(answer.id, None)
                if waiting is not None:
                    waiting[1] = answer
                    waiting[0].set()
        except (anyio.EndOfStream, anyio.IncompleteRead, anyio.BrokenResourceError, anyio.ClosedResourceError):
            pass

    async def call(self, request: Any, timeout_s: float = 30.0) -> dict[str, Any]:
        self._next_id += 1
        ident, waiting = self._next_id, [anyio.Event(), None]
        self._waiting[ident] = waiting
        try:
            async with self._write:
                await self._stream.send(encode(RequestLine(id=ident, request=request)))
            with anyio.fail_after(timeout_s):
                await waiting[0].wait()
        finally:
            self._waiting.pop(ident, None)
        return waiting[1].result


async def service_block(new: bool, calls: int, tmp: Path) -> float:
    """Loop-thread CPU µs per call of one link to a fresh answering peer."""
    path = tmp / f"s{time.monotonic_ns()}.sock"
    peer = subprocess.Popen([sys.executable, "-c", SERVICE, str(path)], stdout=subprocess.PIPE)
    assert peer.stdout is not None
    await anyio.to_thread.run_sync(peer.stdout.readline)
    call: Callable[[], Awaitable[Any]]
    async with anyio.create_task_group() as tg:
        if new:
            link = await ServiceLink.connect(path)
            call = lambda: link.call(Close(chat_key="c"))  # noqa: E731
        else:
            stream = await connect_unix(path)
            old = AnyioServiceLink(stream)
            tg.start_soon(old.read_answers)
            call = lambda: old.call(Close(chat_key="c"))  # noqa: E731
        for _ in range(50):
            await call()
        t = time.thread_time()
        for _ in range(calls):
            await call()
        took = time.thread_time() - t
        if new:
            link.close()
        else:
            await stream.aclose()
        tg.cancel_scope.cancel()
    await anyio.to_thread.run_sync(peer.wait)
    return took / calls * 1e6


async def block(kind: type, exchanges: int, lines: int, gap_s: float) -> float:
    """Loop-thread CPU µs per exchange over one peer process's ``exchanges``."""
    ours, theirs = socket.socketpair()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(theirs.fileno()), str(lines), str(gap_s)],
                            pass_fds=[theirs.fileno()])
    theirs.close()
    ours.setblocking(False)
    link = await kind.of(ours)
    want = lines * len(LINE)

    async def exchange() -> None:
        await link.send_bytes(b"q")
        got = 0
        while got < want:
            got += len(await link.receive_bytes())

    for _ in range(20):  # warm
        await exchange()
    t = time.thread_time()
    for _ in range(exchanges):
        await exchange()
    took = time.thread_time() - t
    await link.aclose()
    await anyio.to_thread.run_sync(peer.wait)
    return took / exchanges * 1e6


async def main(args: argparse.Namespace) -> None:
    cpu: dict[str, list[float]] = {"anyio": [], "SocketBytes": [], "anyio link": [], "ServiceLink": []}
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        for i in range(args.blocks):
            order = (("anyio", AnyioBytes), ("SocketBytes", SocketBytes))
            for name, kind in order if i % 2 == 0 else tuple(reversed(order)):
                cpu[name].append(await block(kind, args.exchanges, args.lines, args.gap_us / 1e6))
            for name in ("anyio link", "ServiceLink") if i % 2 == 0 else ("ServiceLink", "anyio link"):
                cpu[name].append(await service_block(name == "ServiceLink", args.exchanges * 4, Path(tmp)))
            print(f"block {i + 1}/{args.blocks}: keeper link anyio {cpu['anyio'][-1]:.1f} µs, SocketBytes "
                  f"{cpu['SocketBytes'][-1]:.1f} µs; proxy link anyio {cpu['anyio link'][-1]:.1f} µs, ServiceLink "
                  f"{cpu['ServiceLink'][-1]:.1f} µs", flush=True)
    old, new = statistics.median(cpu["anyio"]), statistics.median(cpu["SocketBytes"])
    print(f"\nmedians of {args.blocks} alternated blocks")
    print(f"keeper link, loop CPU per exchange of {args.lines} lines {args.gap_us:g} µs apart ({args.exchanges} a block):")
    print(f"  anyio socket stream  {old:8.1f} µs  ({old / args.lines:.1f} a line)")
    print(f"  SocketBytes          {new:8.1f} µs  ({new / args.lines:.1f} a line)")
    print(f"  ratio {new / old:.3f}, {(old - new) / args.lines:.1f} µs less a line")
    old, new = statistics.median(cpu["anyio link"]), statistics.median(cpu["ServiceLink"])
    print(f"proxy service link, loop CPU per call ({args.exchanges * 4} a block):")
    print(f"  anyio buffered stream, reader task  {old:8.1f} µs")
    print(f"  ServiceLink                         {new:8.1f} µs")
    print(f"  ratio {new / old:.3f}, {old - new:.1f} µs less a call")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("exchanges", nargs="?", type=int, default=500)
    ap.add_argument("--lines", type=int, default=10)
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--blocks", type=int, default=6)
    a = ap.parse_args()
    anyio.run(main, a, backend=event_loop.BACKEND, backend_options=event_loop.BACKEND_OPTIONS)
