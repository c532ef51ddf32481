"""The event loop's CPU for a turn's lines read from a keeper's socket: anyio's socket stream (the
host's keeper link until stop 54) against sandbox_manager.keeper_link.SocketBytes (a transport of
the loop's own), side by side in one run (issue 16).

    uv run python tests/bench/bench_link_stream.py [EXCHANGES] [--lines 10] [--gap-us 200] [--blocks 6]

A peer process plays the keeper: for each input it writes ``--lines`` lines of 200 bytes,
``--gap-us`` apart (a CLI's events come spaced out, so each is a read of its own). The loop's
thread CPU per exchange (input sent, every line read) is measured for each stream in
alternated blocks; the ratio is the new stream's CPU over the old one's.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import time

import anyio
import anyio.abc

from runner import event_loop
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
    cpu: dict[str, list[float]] = {"anyio": [], "SocketBytes": []}
    for i in range(args.blocks):
        order = (("anyio", AnyioBytes), ("SocketBytes", SocketBytes))
        for name, kind in order if i % 2 == 0 else tuple(reversed(order)):
            cpu[name].append(await block(kind, args.exchanges, args.lines, args.gap_us / 1e6))
        print(f"block {i + 1}/{args.blocks}: anyio {cpu['anyio'][-1]:.1f} µs, SocketBytes "
              f"{cpu['SocketBytes'][-1]:.1f} µs", flush=True)
    old, new = statistics.median(cpu["anyio"]), statistics.median(cpu["SocketBytes"])
    print(f"\nloop CPU per exchange of {args.lines} lines {args.gap_us:g} µs apart, median of {args.blocks} "
          f"alternated blocks of {args.exchanges}:")
    print(f"  anyio socket stream  {old:8.1f} µs  ({old / args.lines:.1f} a line)")
    print(f"  SocketBytes          {new:8.1f} µs  ({new / args.lines:.1f} a line)")
    print(f"  ratio {new / old:.3f}, {(old - new) / args.lines:.1f} µs less a line")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("exchanges", nargs="?", type=int, default=500)
    ap.add_argument("--lines", type=int, default=10)
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--blocks", type=int, default=6)
    a = ap.parse_args()
    anyio.run(main, a, backend=event_loop.BACKEND, backend_options=event_loop.BACKEND_OPTIONS)
