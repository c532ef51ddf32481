"""What the model path of a sealed sandbox adds to a streamed model request (a script, not a test).

    uv run python tests/bench/bench_proxy.py [-n 300] [--container]

Processes as in production: the loopback fixture (``python -m deploy.loopback``) and the model
proxy (a ``ProxyHost`` with one sandbox socket) each run in a process of their own; this
process is the client. For each request body (Claude's and pi's real conversation bodies from
tests/data/loopback, and a small chat body) it sends N streamed requests over one keep-alive
connection along each path, interleaved request by request so every path sees the same
machine load:

* ``direct``  — client → fixture (TCP), the baseline;
* ``proxy``   — client → unix socket → proxy → fixture;
* ``gate``    — client → ca-modelgate (TCP, run on the host), which hands the connection to the
  proxy over the unix socket → proxy → fixture: the whole sealed path minus the container (the
  hand-off happens once per connection; every request after it goes client → proxy directly);
* ``--container``: the same ``gate`` path measured by a client *inside* a network-none
  container of the pinned image (ca-modelgate as its command), after the interleaved run
  (not interleaved: compare it with care on a loaded machine).

Every path uses the same stdlib ``http.client`` (inside the container too). Per path: p50/p99
of the time to the first byte and to the last byte, the p50 added over ``direct`` (the
issue's goal: ≤ 2 ms at p50), and the proxy process's CPU time per request (from /proc: less
sensitive to other load on the machine than wall time).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402

from deploy.loopback import load_jsonl  # noqa: E402

DATA = ROOT / "tests" / "data" / "loopback"
GATE = ROOT / "images" / "sandbox" / "helpers" / "ca-modelgate"
MEMBER = "/m/bench"


def quiet() -> None:
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))


def bodies() -> dict[str, tuple[str, bytes]]:
    def last(name: str) -> bytes:
        rec = [r for r in load_jsonl(DATA / name) if r.kind == "conversation" and r.status == 200][-1]
        return json.dumps({**rec.body, "stream": True}).encode()

    claude, pi = last("claude-2.1.220.jsonl"), last("pi-0.73.1.jsonl")
    chat = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "a short question"}]})
    return {"claude-78KB": ("/v1/messages?beta=true", claude), f"pi-{len(pi) // 1024}KB": ("/v1/messages", pi),
            "chat-small": ("/v1/chat/completions", chat.encode())}


# ---------------------------------------------------------------- the proxy process


def serve_proxy(upstream: str, directory: str) -> None:
    """``--serve-proxy``: run a ProxyHost with one sandbox until stdin closes."""
    import anyio

    from proxy import ProxyConfig, ProxyHost

    quiet()
    key = Path(directory) / "key"
    key.write_text("sk-bench-real-key-0000\n")

    async def main() -> None:
        async with ProxyHost(ProxyConfig(upstream_url=upstream, key_file=key)) as host:
            path = await host.open_sandbox("bench", Path(directory) / "sock", user_id="bench")
            print(path, flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)

    anyio.run(main)


# ---------------------------------------------------------------- measuring


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("sandbox")
        self.unix_path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.unix_path)


def once(conn: http.client.HTTPConnection, target: str, body: bytes) -> tuple[float, float]:
    """One streamed request on a keep-alive connection: (ms to the first byte, ms to the last)."""
    t0 = time.perf_counter()
    conn.request("POST", target, body=body, headers={"content-type": "application/json"})
    resp = conn.getresponse()
    first = None
    while True:
        chunk = resp.read1(65536)
        if first is None:
            first = time.perf_counter()
        if not chunk:
            break
    end = time.perf_counter()
    assert resp.status == 200, resp.status
    return (first - t0) * 1000, (end - t0) * 1000


def cpu_ms(pid: int) -> float:
    """User + system CPU time a process has used so far (ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], p: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1] if len(values) > 1 else values[0]


CONTAINER_CLIENT = r"""
import http.client, json, sys, time
path, n, body = sys.argv[1], int(sys.argv[2]), open(sys.argv[3], 'rb').read()
c = http.client.HTTPConnection('127.0.0.1', 18080)
out = []
for i in range(n + 20):
    t0 = time.perf_counter(); c.request('POST', path, body=body, headers={'content-type': 'application/json'})
    r = c.getresponse(); first = None
    while True:
        chunk = r.read1(65536)
        if first is None: first = time.perf_counter()
        if not chunk: break
    end = time.perf_counter()
    if i >= 20: out.append([(first - t0) * 1000, (end - t0) * 1000])
print(json.dumps(out))
"""


def in_container(image: str, socket_dir: str, n: int, path: str, body: bytes) -> list[tuple[float, float]]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as tmp:
        Path(tmp, "client.py").write_text(CONTAINER_CLIENT)
        Path(tmp, "body.json").write_bytes(body)
        os.chmod(tmp, 0o755)
        name = f"bench-proxy-{os.getpid()}"
        subprocess.run(["docker", "run", "-d", "--rm", "--init", "--network", "none", "--user", "agent",
                        "--name", name, "-v", f"{socket_dir}:/run/cloud-agent/model:ro", "-v", f"{tmp}:/bench:ro",
                        image, "ca-modelgate", "--socket", "/run/cloud-agent/model/model.sock"],
                       check=True, capture_output=True)
        try:
            logs = subprocess.Popen(["docker", "logs", "-f", name], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                    text=True)
            assert "modelgate.listening" in logs.stderr.readline()  # type: ignore[union-attr]
            logs.kill()
            out = subprocess.run(["docker", "exec", name, "python3", "/bench/client.py", MEMBER + path, str(n),
                                  "/bench/body.json"], capture_output=True, text=True)
            if out.returncode:
                raise RuntimeError(f"client in the container failed: {out.stderr[-2000:]}")
        finally:
            subprocess.run(["docker", "rm", "-f", name], capture_output=True)
    return [tuple(x) for x in json.loads(out.stdout)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("-n", type=int, default=300, help="requests per path and body")
    parser.add_argument("--container", action="store_true", help="also measure from inside a sealed container")
    parser.add_argument("--serve-proxy", nargs=2, metavar=("UPSTREAM", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_proxy:
        serve_proxy(*args.serve_proxy)
        return
    quiet()
    work = Path(tempfile.mkdtemp(prefix="bench-proxy-", dir="/var/tmp"))
    procs: list[subprocess.Popen] = []
    try:
        fixture = subprocess.Popen([sys.executable, "-m", "deploy.loopback", "--port", "0"], cwd=ROOT,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
        procs.append(fixture)
        line = ""
        while "listening on" not in line:
            line = fixture.stdout.readline()  # type: ignore[union-attr]
        upstream = line.strip().rsplit(" ", 1)[-1]
        proxy = subprocess.Popen([sys.executable, __file__, "--serve-proxy", upstream, str(work)],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(proxy)
        sock = proxy.stdout.readline().strip()  # type: ignore[union-attr]
        port = free_port()
        gate = subprocess.Popen([sys.executable, str(GATE), "--socket", sock, "--listen", f"127.0.0.1:{port}"],
                                stderr=subprocess.PIPE, text=True)
        procs.append(gate)
        assert "modelgate.listening" in gate.stderr.readline()  # type: ignore[union-attr]
        fixture_port = int(upstream.rsplit(":", 1)[1])
        clients: dict[str, tuple[http.client.HTTPConnection, str]] = {
            "direct": (http.client.HTTPConnection("127.0.0.1", fixture_port), ""),
            "proxy": (UnixHTTPConnection(sock), MEMBER),
            "gate": (http.client.HTTPConnection("127.0.0.1", port), MEMBER),
        }
        print(f"n={args.n} per path; ms; interleaved request by request; cpus={os.cpu_count()}")
        print(f"{'body':<12} {'path':<10} {'ttfb p50':>9} {'ttfb p99':>9} {'total p50':>10} {'total p99':>10}"
              f" {'+p50 vs direct':>15}")
        for label, (path, body) in bodies().items():
            times: dict[str, list[tuple[float, float]]] = {k: [] for k in clients}
            cpu0, fx0, gate0 = cpu_ms(proxy.pid), cpu_ms(fixture.pid), cpu_ms(gate.pid)
            for i in range(args.n + 20):
                for name, (client, base) in clients.items():
                    t = once(client, base + path, body)
                    if i >= 20:
                        times[name].append(t)
            proxy_cpu = (cpu_ms(proxy.pid) - cpu0) / (2 * (args.n + 20))  # the proxy and gate paths
            fixture_cpu = (cpu_ms(fixture.pid) - fx0) / (3 * (args.n + 20))  # every path ends there
            gate_cpu = (cpu_ms(gate.pid) - gate0) / (args.n + 20)
            if args.container:
                from images.build import ensure_image

                times["container"] = in_container(ensure_image(), str(Path(sock).parent), args.n, path, body)
            base_p50 = statistics.median(t for _, t in times["direct"])
            for name, ts in times.items():
                first, total = [a for a, _ in ts], [b for _, b in ts]
                added = statistics.median(total) - base_p50
                print(f"{label:<12} {name:<10} {statistics.median(first):>9.3f} {pct(first, 99):>9.3f} "
                      f"{statistics.median(total):>10.3f} {pct(total, 99):>10.3f} "
                      f"{'' if name == 'direct' else f'{added:+.3f}':>15}")
            print(f"{label:<12} CPU per request (ms): proxy {proxy_cpu:.3f}, ca-modelgate {gate_cpu:.3f}, "
                  f"fixture {fixture_cpu:.3f}")
        for client, _ in clients.values():
            client.close()
    finally:
        for p in procs:
            if p.stdin:
                p.stdin.close()
            p.terminate()
            p.wait(10)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
