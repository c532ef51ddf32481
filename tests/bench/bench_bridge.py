"""Live-bridge benchmark (a script, not a test).

    uv run python tests/bench/bench_bridge.py [--runtime opencode|kilo|both] [--turns 20]

Side by side in the same run, against the same loopback fixture and the pinned CLIs on this
host (``R=/var/tmp/cloud-agent-build/ctx-…``, see docs/driver-brief.md):

* **bridge**: ``BridgeDriver`` + ``LocalProcessTransport`` + ``http-agent-live-bridge`` (the
  full driver path: prompt line in, ``settled`` line out, REST settlement check included);
* **direct**: a minimal client of a second server started with the same environment:
  ``POST /session/S/prompt_async`` then wait on ``GET /event`` for the root ``session.idle``
  (no settlement cross-check, no attribution): the floor any driver pays.

Turns alternate bridge/direct so machine noise hits both alike. Also printed: time to a
usable session (bridge hello+open vs direct server ready + session create) and the bridge
process's RSS next to the server's.
"""

from __future__ import annotations

import argparse
import base64
import http.client
import json
import os
import queue
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from deploy.loopback import LoopbackFixture  # noqa: E402
from drivers.bridge import BridgeDriver  # noqa: E402
from drivers.models import DriverOptions, GatewayConfig, MemberPaths, Settlement  # noqa: E402
from images.pins import load_pins  # noqa: E402
from tests.support.bridge_replay import BRIDGE_PATH, bridge_module  # noqa: E402
from tests.support.local_process import LocalProcessTransport  # noqa: E402

BUILD = os.environ.get("CA_BUILD_CTX", "/var/tmp/cloud-agent-build/ctx-8513ace37ce2")
PATH = f"{BUILD}/runtime/usr/local/bin:{BUILD}/agents/usr/local/bin:/usr/local/bin:/usr/bin:/bin"


class Direct:
    """A bare client of one server: prompt_async + wait for the root session.idle on SSE."""

    def __init__(self, runtime: str, env: dict[str, str], cwd: str) -> None:
        os.environ["PATH"] = env["PATH"]  # server_command resolves the binary on PATH, as the bridge does
        cmd, extra = bridge_module().server_command(runtime)
        password = secrets.token_urlsafe(16)
        prefix = "OPENCODE" if runtime == "opencode" else "KILO"
        full = {**env, **extra, f"{prefix}_SERVER_USERNAME": "b", f"{prefix}_SERVER_PASSWORD": password,
                "CA_GATEWAY_KEY": "sk-bench"}
        self.auth = "Basic " + base64.b64encode(f"b:{password}".encode()).decode()
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([*cmd, "serve", "--port", "0", "--hostname", "127.0.0.1"], cwd=cwd, env=full,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            m = re.search(rb"listening on http://127.0.0.1:(\d+)", raw)
            if m:
                self.port = int(m.group(1))
                break
        threading.Thread(target=lambda: [None for _ in self.proc.stdout], daemon=True).start()  # type: ignore[union-attr]
        self.q: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._sse, daemon=True).start()
        self.q.get(timeout=30)  # server.connected
        self.sid = self.call("POST", "/session", {"title": "bench"})["id"]
        self.ready_s = time.perf_counter() - t0
        self.mint = bridge_module().Minter()

    def _sse(self) -> None:
        c = http.client.HTTPConnection("127.0.0.1", self.port)
        c.request("GET", "/event", headers={"authorization": self.auth})
        r = c.getresponse()
        while line := r.readline():
            if line.startswith(b"data: "):
                self.q.put(json.loads(line[6:]))

    def call(self, method: str, path: str, body: object = None) -> object:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"authorization": self.auth, "content-type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return json.loads(data) if data else None

    def turn(self, text: str) -> float:
        while not self.q.empty():
            self.q.get_nowait()
        t0 = time.perf_counter()
        self.call("POST", f"/session/{self.sid}/prompt_async",
                  {"messageID": self.mint(), "parts": [{"type": "text", "text": text}]})
        while True:
            ev = self.q.get(timeout=60)
            if ev.get("type") == "session.idle" and ev["properties"].get("sessionID") == self.sid:
                return time.perf_counter() - t0

    def close(self) -> None:
        os.killpg(self.proc.pid, 15)
        self.proc.wait(10)


def rss_kb(pid: int) -> int:
    try:
        return int(re.search(r"VmRSS:\s+(\d+)", Path(f"/proc/{pid}/status").read_text()).group(1))  # type: ignore[union-attr]
    except (OSError, AttributeError):
        return 0


def stats(xs: list[float]) -> str:
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(len(xs) * 0.9))]
    return f"median {statistics.median(xs) * 1000:7.1f} ms  p90 {p90 * 1000:7.1f} ms  n={len(xs)}"


async def bench(runtime: str, turns: int) -> None:
    base = Path(tempfile.mkdtemp(prefix=f"bench-bridge-{runtime}-"))
    try:
        with LoopbackFixture.start() as fx:
            gw = GatewayConfig(base_url=fx.base_url, key="sk-bench", model="bench-model")
            driver = BridgeDriver(runtime, DriverOptions(helper_version=load_pins().helper.version), path=PATH,
                                  bridge_command=("python3", str(BRIDGE_PATH)))
            paths = MemberPaths(home=str(base / "b" / "home"), workspace=str(base / "b" / "ws"),
                                run_dir=str(base / "b" / "run"))
            launch = driver.plan(paths, gw, None)
            t0 = time.perf_counter()
            t = await LocalProcessTransport.start(launch.spec, run_dir=Path(paths.run_dir))
            s = driver.session(t, launch)
            await s.handshake()
            bridge_ready = time.perf_counter() - t0

            dpaths = MemberPaths(home=str(base / "d" / "home"), workspace=str(base / "d" / "ws"),
                                 run_dir=str(base / "d" / "run"))
            dlaunch = driver.plan(dpaths, gw, None)
            dlaunch.spec.materialize_files_locally()
            direct = await anyio.to_thread.run_sync(lambda: Direct(runtime, dict(dlaunch.spec.env), dpaths.workspace))

            # warm-up: the first turn after a server start pays the instance bootstrap
            first_bridge = time.perf_counter()
            assert isinstance(await s.run_turn("warm up"), Settlement)
            first_bridge = time.perf_counter() - first_bridge
            first_direct = await anyio.to_thread.run_sync(direct.turn, "warm up")
            tb, td = [], []
            for i in range(turns):
                t1 = time.perf_counter()
                out = await s.run_turn(f"bench turn {i}")
                tb.append(time.perf_counter() - t1)
                assert isinstance(out, Settlement) and not out.is_error, out
                td.append(await anyio.to_thread.run_sync(direct.turn, f"bench turn {i}"))
            pgid = int((Path(paths.run_dir) / "cli.pid").read_text())
            children = subprocess.run(["pgrep", "-P", str(pgid)], capture_output=True, text=True).stdout.split()
            server_rss = sum(rss_kb(int(c)) for c in children)
            print(f"\n== {runtime}  ({turns} turns each, alternating, fixture default replies)")
            print(f"  session ready   bridge {bridge_ready:6.2f} s (server start + SSE + hello + open)   "
                  f"direct {direct.ready_s:6.2f} s (server start + SSE + create)")
            print(f"  first turn      bridge {first_bridge * 1000:7.1f} ms   direct {first_direct * 1000:7.1f} ms")
            print(f"  turn (bridge)   {stats(tb)}")
            print(f"  turn (direct)   {stats(td)}")
            print(f"  bridge overhead per turn: {(statistics.median(tb) - statistics.median(td)) * 1000:+.1f} ms "
                  f"(median of bridge minus median of direct)")
            print(f"  RSS: bridge (python) {rss_kb(pgid) / 1024:.1f} MiB, its server {server_rss / 1024:.1f} MiB")
            await s.close()
            with anyio.move_on_after(10):
                await t.wait()
            await t.kill()
            direct.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runtime", choices=("opencode", "kilo", "both"), default="both")
    ap.add_argument("--turns", type=int, default=20)
    args = ap.parse_args()
    for runtime in ("opencode", "kilo") if args.runtime == "both" else (args.runtime,):
        anyio.run(bench, runtime, args.turns)


if __name__ == "__main__":
    main()
