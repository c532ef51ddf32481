"""Issue 12: a sandbox is a boundary. Run as the sandbox's own ``agent`` user, per runtime, after
a real turn (the CLI still resident): no TCP connect reaches the daemon, the fixture or any other
host port; the real gateway key is in no ``/proc/*/environ`` or ``cmdline``, no file under the
agent's home, no ``docker inspect`` field, log or receipt; the model proxy answers anything but
a model route 403; a request on one chat's socket is that chat's, whatever member key it names;
and the fixture's records show the real key did arrive upstream (its fingerprint).
"""

from __future__ import annotations

import json
import socket
import sqlite3
import uuid
from pathlib import Path

import httpx
import pytest

from deploy.loopback import LoopbackFixture
from deploy.loopback.recorder import fingerprint
from sandbox_manager.identity import member_key
from tests.cli.attestation_helpers import spawn_daemon
from tests.supervisor_helpers import Chat, available_runtimes

pytestmark = [pytest.mark.cli, pytest.mark.docker]

# Runs inside the sandbox as `agent` (stdlib only): every probe's result as one JSON line.
PROBE = r"""
import json, os, socket, sys, http.client
# the key comes hex-encoded: this probe's own cmdline must not hold the key it looks for
key, ports = bytes.fromhex(sys.argv[1]).decode(), [int(p) for p in sys.argv[2].split(",")]
out = {"connect": {}, "environ": 0, "cmdline": 0, "key_in": [], "http": {}}
for port in ports:
    s = socket.socket()
    s.settimeout(3)
    try:
        s.connect(("127.0.0.1", port))
        out["connect"][port] = "connected"
    except OSError as exc:
        out["connect"][port] = type(exc).__name__
    finally:
        s.close()
out["interfaces"] = sorted(os.listdir("/sys/class/net"))
out["routes"] = open("/proc/net/route").read().splitlines()[1:]
for pid in filter(str.isdigit, os.listdir("/proc")):
    for name in ("environ", "cmdline"):
        try:
            data = open(f"/proc/{pid}/{name}", "rb").read()
        except OSError:
            continue
        out[name] += 1
        if key.encode() in data:
            out["key_in"].append(f"/proc/{pid}/{name}")
for root, _, files in os.walk("/home/agent"):
    for f in files:
        try:
            if key.encode() in open(os.path.join(root, f), "rb").read():
                out["key_in"].append(os.path.join(root, f))
        except OSError:
            pass
for method, path in (("GET", "/m/m1/_fixture/requests"), ("POST", "/m/m1/_fixture/rules"), ("GET", "/v1/models"),
                     ("POST", "/v1/messages"), ("POST", "/m/m1/v1/../_fixture/reset"), ("GET", "/m/m1/metrics")):
    c = http.client.HTTPConnection("127.0.0.1", 18080, timeout=10)
    c.request(method, path, body=b"{}" if method == "POST" else None, headers={"x-api-key": "stolen?"})
    out["http"][f"{method} {path}"] = c.getresponse().status
    c.close()
out["model_dir"] = sorted(os.listdir("/run/cloud-agent/model"))
# what a CLI's telemetry or update check meets: a lookup and a connect that fail at once (no
# interface but lo, no route: nothing leaves the sandbox), in Python and in Node (the CLIs' own)
import subprocess, time
def timed(f):
    t = time.monotonic()
    try:
        f()
        result = "ok"
    except OSError as exc:
        result = type(exc).__name__
    return [result, round((time.monotonic() - t) * 1000)]
out["lookup"] = {n: timed(lambda n=n: socket.getaddrinfo(n, 443)) for n in NAMES}
out["connect_out"] = timed(lambda: socket.create_connection(("192.0.2.1", 443), timeout=30))
node = subprocess.run(["node", "-e", NODE_PROBE, *NAMES], capture_output=True, text=True, timeout=60)
out["node"] = json.loads(node.stdout.strip().splitlines()[-1]) if node.returncode == 0 else node.stderr
print(json.dumps(out))
"""
# names the pinned CLIs' telemetry, update and catalogue checks use (192.0.2.1 is TEST-NET-1)
NAMES = ["statsig.anthropic.com", "registry.npmjs.org", "models.dev", "api.openai.com"]
NODE_PROBE = r"""
const dns = require('dns'), net = require('net');
const names = process.argv.slice(1), out = {lookup: {}};
const timed = (start, f) => new Promise(done => f(err => done([err ? err.code : 'ok', Date.now() - start])));
(async () => {
  for (const n of names) out.lookup[n] = await timed(Date.now(), cb => dns.lookup(n, e => cb(e)));
  out.connect_out = await timed(Date.now(), cb => {
    const s = net.connect({host: '192.0.2.1', port: 443, timeout: 30000}, () => { s.destroy(); cb(null); });
    s.on('error', e => cb(e)); s.on('timeout', () => { s.destroy(); cb({code: 'TIMEOUT'}); });
  });
  console.log(JSON.stringify(out));
})();
"""
PROBE = PROBE.replace("NAMES", repr(NAMES)).replace("NODE_PROBE", repr(NODE_PROBE))
FAIL_FAST_MS = 500  # a wait would be the resolver's or TCP's own timeout: seconds


@pytest.fixture(scope="module")
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


def run(client: httpx.Client, job: dict) -> dict:
    resp = client.post("/v1/jobs", json=job)
    assert resp.status_code == 200, resp.text
    return json.loads(resp.text.strip().splitlines()[-1])["receipt"]


def start(tmp_path: Path, fx: LoopbackFixture, image: str, key: str):
    home = tmp_path / "home"
    home.mkdir()
    (home / "gateway-key").write_text(key + "\n")
    (home / "token").write_text("sealed-test-token-0123456789\n")
    env = {"CLOUD_AGENT_GATEWAY_KEY_FILE": str(home / "gateway-key"),
           "CLOUD_AGENT_SERVICE_TOKEN_FILE": str(home / "token"), "CLOUD_AGENT_GATEWAY_URL": fx.base_url,
           "CLOUD_AGENT_IMAGE": image, "CLOUD_AGENT_HOST_ID": f"sealed-{uuid.uuid4().hex[:8]}"}
    return home, spawn_daemon(home, env)


@pytest.mark.parametrize("runtime", available_runtimes())
def test_the_sandbox_is_sealed_and_never_holds_the_key(runtime, fx, tmp_path, sandbox_image, docker_client) -> None:
    key = f"gwkey-{uuid.uuid4().hex}-REAL"
    listener = socket.create_server(("127.0.0.1", 0))  # a host port that is listening right now
    other_port = listener.getsockname()[1]
    home, daemon = start(tmp_path, fx, sandbox_image, key)
    chat = Chat(runtime)
    with listener, daemon as d, httpx.Client(base_url=d.url, timeout=300, headers={
            "authorization": "Bearer sealed-test-token-0123456789"}) as client:
        mark = max((r.seq for r in fx.requests()), default=0)
        chat.expect_turn("hello from inside")
        receipt = run(client, chat.job("hello from inside"))
        assert (receipt["context_status"], receipt["outcome"]) == ("NEW", "succeeded"), receipt
        assert receipt["wire"]["history"] == "new"
        container = docker_client.containers.get(receipt["sandbox"]["container_id"])
        ports = [int(d.url.rsplit(":", 1)[1]), fx.port, other_port]
        res = container.exec_run(["python3", "-c", PROBE, key.encode().hex(), ",".join(map(str, ports))],
                                 user="agent")
        assert res.exit_code == 0, res.output.decode()
        out = json.loads(res.output.decode().strip().splitlines()[-1])
        assert out["connect"] == {str(p): "ConnectionRefusedError" for p in ports}
        assert (out["interfaces"], out["routes"]) == (["lo"], [])
        assert out["key_in"] == []
        assert out["environ"] >= 3 and out["cmdline"] >= 3  # the CLI's own processes were read
        assert out["http"] == {"GET /m/m1/_fixture/requests": 403, "POST /m/m1/_fixture/rules": 403,
                               "GET /v1/models": 403, "POST /v1/messages": 403,
                               "POST /m/m1/v1/../_fixture/reset": 403, "GET /m/m1/metrics": 403}
        assert out["model_dir"] == ["model.sock"]
        # telemetry and update checks fail fast, in Python and in Node: no lookup answers, no
        # connect leaves, none waits
        for probe in (out, out["node"]):
            assert set(probe["lookup"]) == set(NAMES), out
            assert all(r != "ok" and ms < FAIL_FAST_MS for r, ms in probe["lookup"].values()), out
            assert probe["connect_out"][0] in ("OSError", "ENETUNREACH") and probe["connect_out"][1] < FAIL_FAST_MS, out
        container.reload()
        assert key not in json.dumps(container.attrs)
        for exec_id in container.attrs.get("ExecIDs") or []:
            assert key not in json.dumps(docker_client.api.exec_inspect(exec_id))
        fetched = client.get(f"/v1/jobs/{receipt['job_id']}", params={"user_id": chat.user_id})
        assert fetched.status_code == 200 and key not in fetched.text
        proxy_log = (home / "proxy" / "service.log").read_text()  # the model proxy service's own log
        assert key not in d.log() and key not in proxy_log and '"event": "proxy.request"' in proxy_log
        # the real key arrived upstream, in the route's own header; no placeholder did
        turn = [r for r in fx.requests() if r.seq > mark and r.kind != "probe"]
        assert turn, "no model request reached the fixture"
        header = "x-api-key" if runtime in ("claude", "pi") else "authorization"
        want = fingerprint(key) if header == "x-api-key" else f"Bearer {fingerprint(key)}"
        assert {json.dumps(r.credentials, sort_keys=True) for r in turn} == {json.dumps({header: want})}
    for path in home.rglob("*"):
        if path.is_file() and path.name != "gateway-key":
            assert key.encode() not in path.read_bytes(), f"the key is in the daemon's state file {path}"


def test_a_socket_speaks_for_its_own_chat_only(fx, tmp_path, sandbox_image, docker_client) -> None:
    key = f"gwkey-{uuid.uuid4().hex}-REAL"
    home, daemon = start(tmp_path, fx, sandbox_image, key)
    a, b = Chat("codex"), Chat("codex", member_id="m-b")
    with daemon as d, httpx.Client(base_url=d.url, timeout=300, headers={
            "authorization": "Bearer sealed-test-token-0123456789"}) as client:
        receipts = {}
        for chat in (a, b):
            chat.expect_turn("hello")
            receipts[chat.chat_id] = run(client, chat.job("hello"))
            assert receipts[chat.chat_id]["outcome"] == "succeeded"
        # from A's sandbox, a request that names B's member key
        container = docker_client.containers.get(receipts[a.chat_id]["sandbox"]["container_id"])
        script = ("import http.client; c = http.client.HTTPConnection('127.0.0.1', 18080, timeout=30); "
                  f"c.request('POST', '/m/{member_key(b.member_id)}/v1/responses', body=b'{{\"model\": \"x\"}}', "
                  "headers={'content-type': 'application/json'}); print(c.getresponse().status)")
        res = container.exec_run(["python3", "-c", script], user="agent")
        assert res.exit_code == 0, res.output
    db = sqlite3.connect(home / "store.db")
    db.row_factory = sqlite3.Row
    rows = [dict(r) for r in db.execute("SELECT user_id, chat_id, member_id, job_id, record_json FROM wire_records")]
    forged = [r for r in rows if json.loads(r["record_json"])["member_key"] == member_key(b.member_id)
              and r["job_id"] is None]
    assert [(r["user_id"], r["chat_id"], r["member_id"]) for r in forged] == [(a.user_id, a.chat_id, None)]
    assert json.loads(forged[0]["record_json"])["chat_key"] == json.loads(
        next(r for r in rows if r["chat_id"] == a.chat_id and r["job_id"])["record_json"])["chat_key"]
    # B's ledger holds only B's own turn
    assert {r["job_id"] for r in rows if r["chat_id"] == b.chat_id} == {receipts[b.chat_id]["job_id"]}
