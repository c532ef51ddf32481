"""What one hop of the turn path costs on this machine, and the floor they set for a LIVE turn
(issue 16's "≤ 5 ms added"), measured side by side in one run.

    uv run python tests/bench/bench_hops.py [-n 400]

A LIVE turn through the daemon crosses a fixed set of boundaries that the bare arm of
``bench_supervisor.py`` (the same driver on its own exec) never does; each is asked for by the
SPEC or an issue, not by an implementation choice:

* the job API: one HTTP exchange between the client's process and the daemon (SPEC 3);
* the store: the job fence's claim (SPEC 8: a job id never runs the CLI twice, across a crash
  too) and the receipt's commit, each a durable transaction on the store's worker thread (this
  bench times the WAL's ``synchronous=FULL`` commit; since stop 51 the daemon's claim and commit
  are relaxed ones whose fsync the store's flusher process makes: bench_store_commits.py);
* the model proxy's control channel: the proxy learns whose requests are the job's before the
  message reaches the CLI, and is flushed before the verdict (SPEC 12, issue 12's proxy
  service, a process of its own so that sandboxes keep their model socket across daemon
  restarts);
* the keeper: the message in and the CLI's events out pass through ``ca-keeper`` (issue 14:
  residents survive daemon restarts), one process more each way.

Sealing (each model request through the proxy process, issue 12) is not among them: the bare
arm's CLI runs in the same sealed sandbox and reaches the model the same way.

Interleaved sample by sample, this measures the round trip of each kind of hop with the same
libraries the daemon uses: an anyio worker-thread hop beside the store's own thread's
(state.store_thread), a durable SQLite commit on the latter, a unix-socket round trip to another process, and an HTTP/1.1 exchange with a uvicorn (httptools)
server in another process, from the leanest client possible and from httpx. It prints their p50s and the sum for the
*fewest* hops a LIVE turn can make under those requirements, with the leanest client: a
floor no implementation on this machine gets below, printed next to the issue's 5 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx

from state.store_thread import StoreThread

SERVER = """
import sys, uvicorn
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    while (await receive()).get("more_body"):
        pass
    body = b'{"type": "receipt"}\\n'
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson"), (b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body, "more_body": False})
uvicorn.run(app, uds=sys.argv[1], log_level="warning", http="httptools", lifespan="off", access_log=False)
"""

ECHO = """
import socket, sys
s = socket.socket(fileno=int(sys.argv[1]))
while (data := s.recv(65536)):
    s.sendall(data)
"""

# The fewest hops of each kind a LIVE turn makes under the requirements in the docstring.
FLOOR = (("http", 1, "the job API exchange"),
         ("commit", 2, "the claim and the receipt's commit"),
         ("process", 2, "the proxy's begin and flush"),
         ("process", 1, "the keeper: message in, events out"))


def pct(xs: list[float], p: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(p / 100 * (len(s) - 1)))]


class Commit:
    """A durable one-row transaction, as the store's ``_tx`` on its own thread."""

    def __init__(self, path: Path) -> None:
        self.db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("CREATE TABLE jobs (id INTEGER PRIMARY KEY, body TEXT)")
        self.thread = StoreThread("bench commit")

    def _tx(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")
        self.db.execute("INSERT INTO jobs (body) VALUES (?)", ("x" * 400,))
        self.db.execute("COMMIT")

    async def __call__(self) -> None:
        await self.thread.run(self._tx)


async def main(n: int) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-hops-"))
    sock = str(work / "http.sock")
    server = subprocess.Popen([sys.executable, "-c", SERVER, sock])
    ours, theirs = socket.socketpair()
    echo = subprocess.Popen([sys.executable, "-c", ECHO, str(theirs.fileno())], pass_fds=[theirs.fileno()])
    theirs.close()
    ours.setblocking(False)
    loop = asyncio.get_running_loop()
    commit = Commit(work / "store.db")
    try:
        with anyio.fail_after(30):
            while not os.path.exists(sock):
                await anyio.sleep(0.02)
        async with httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=sock), base_url="http://daemon") as client:

            store_thread = StoreThread("bench hop")

            async def thread() -> None:
                await anyio.to_thread.run_sync(lambda: None)

            async def store() -> None:
                await store_thread.run(lambda: None)

            async def process() -> None:
                await loop.sock_sendall(ours, b"x" * 64)
                got = 0
                while got < 64:
                    got += len(await loop.sock_recv(ours, 65536))

            async def httpx_client() -> None:
                async with client.stream("POST", "/v1/jobs", json={"message": "live"}) as resp:
                    async for _ in resp.aiter_lines():
                        pass

            raw = socket.socket(socket.AF_UNIX)
            raw.setblocking(False)
            await loop.sock_connect(raw, sock)
            body = b'{"message": "live"}'
            request = (b"POST /v1/jobs HTTP/1.1\r\nhost: daemon\r\ncontent-type: application/json\r\n"
                       b"content-length: %d\r\n\r\n%s" % (len(body), body))

            async def http() -> None:  # the leanest client: one write, read to the end of the body
                await loop.sock_sendall(raw, request)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += await loop.sock_recv(raw, 65536)
                head, _, rest = data.partition(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
                while len(rest) < length:
                    rest += await loop.sock_recv(raw, 65536)

            hops = {"thread": thread, "store": store, "commit": commit, "process": process, "http": http, "httpx": httpx_client}
            for fn in hops.values():  # warm up: connections, thread pool, page cache
                for _ in range(20):
                    await fn()
            samples: dict[str, list[float]] = {k: [] for k in hops}
            for i in range(n):
                order = list(hops.items()) if i % 2 == 0 else list(reversed(hops.items()))
                for name, fn in order:
                    t = time.perf_counter()
                    await fn()
                    samples[name].append((time.perf_counter() - t) * 1000)
    finally:
        ours.close()
        raw.close()
        server.terminate()
        echo.terminate()
        server.wait(10)
        echo.wait(10)
    what = {"thread": "anyio worker-thread hop (no work)", "store": "the store's own thread's hop (no work)",
            "commit": "durable SQLite commit on the store's thread",
            "process": "unix-socket round trip to another process",
            "http": "HTTP/1.1 exchange with uvicorn, the leanest client (one write, read to the end)",
            "httpx": "the same exchange from httpx (the benches' API client)"}
    print(f"one hop of each kind, round trip, n={n} interleaved; load {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(f"{'hop':9}{'p50 ms':>9}{'p90 ms':>9}  what")
    for name, xs in samples.items():
        print(f"{name:9}{pct(xs, 50):9.3f}{pct(xs, 90):9.3f}  {what[name]}")
    total = 0.0
    print("\nthe fewest hops of a LIVE turn (see the docstring), at p50:")
    for name, count, why in FLOOR:
        ms = count * statistics.median(samples[name])
        total += ms
        print(f"  {count} x {name:8} {ms:7.3f} ms  {why}")
    print(f"  floor       {total:7.3f} ms  (issue 16's goal: LIVE added <= 5 ms at p50)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("-n", type=int, default=400)
    anyio.run(main, ap.parse_args().n)
