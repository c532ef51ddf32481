"""Per-request overhead of the loopback fixture (a script, not a test).

    uv run python tests/bench/bench_fixture.py [-n 300]

For each API shape it streams N requests (real recorded CLI bodies from tests/data/loopback/)
through one keep-alive client and prints the median wall time, next to a bare stdlib
``ThreadingHTTPServer`` that echoes the same body back, measured in the same run, and the
ratio. The difference is what the fixture itself costs: JSON parsing, the audit, the rule
lookup, SSE rendering, chunked writes and recording.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deploy.loopback import LoopbackFixture, load_jsonl
from telemetry.logs import configure_logging

DATA = ROOT / "tests" / "data" / "loopback"
SAMPLES = {"anthropic": ("claude-2.1.220.jsonl", "/v1/messages?beta=true"),
           "responses": ("codex-0.171.0.jsonl", "/v1/responses"),
           "chat": ("pi-0.73.1.jsonl", "/v1/chat/completions")}


class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def setup(self) -> None:
        super().setup()
        # same socket option as the fixture, or both would measure Nagle's ~40 ms instead
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def do_POST(self) -> None:
        data = self.rfile.read(int(self.headers["content-length"]))
        self.send_response(200)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def body_for(api: str) -> bytes:
    name, _ = SAMPLES[api]
    rec = [r for r in load_jsonl(DATA / name) if r.kind == "conversation" and r.status == 200][-1]
    return json.dumps({**rec.body, "stream": True}).encode()


def median_ms(url: str, body: bytes, n: int) -> float:
    times = []
    with httpx.Client(timeout=10, headers={"content-type": "application/json"}) as client:
        for i in range(n + 20):
            t0 = time.perf_counter()
            with client.stream("POST", url, content=body) as resp:
                for _ in resp.iter_bytes():
                    pass
            if i >= 20:  # warm-up excluded
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=300, help="requests per API shape")
    args = parser.parse_args()
    configure_logging(level="WARNING")
    echo = ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    echo.daemon_threads = True
    threading.Thread(target=echo.serve_forever, daemon=True).start()
    echo_url = f"http://127.0.0.1:{echo.server_address[1]}"
    print(f"{'api':<10} {'body':>8} {'fixture ms':>11} {'echo ms':>8} {'ratio':>6}")
    with LoopbackFixture.start() as fx:
        for api, (_, path) in SAMPLES.items():
            body = body_for(api)
            fixture = median_ms(fx.base_url + path, body, args.n)
            baseline = median_ms(echo_url + path, body, args.n)
            fx.reset()  # keep the recorder from growing across shapes
            print(f"{api:<10} {len(body):>8} {fixture:>11.3f} {baseline:>8.3f} {fixture / baseline:>6.2f}")
    echo.shutdown()


if __name__ == "__main__":
    main()
