"""The gateway key and the service token never appear in container labels, config env or
command, image layers or config, exec arguments, the daemon's log, receipts, events, the store,
error answers or the sandbox's files — after a full conversation and after a failing turn.

Since issue 12 that includes /proc/<pid>/environ of the CLI inside the sandbox: the CLI holds a
placeholder, the host's model proxy holds the key (the fixture's records prove the real key was
in play). tests/cli/test_security_sealed.py checks the same per runtime, as the agent user.
"""

from __future__ import annotations

import json
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest

from deploy.loopback import LoopbackFixture, reject
from deploy.loopback.recorder import fingerprint
from tests.cli.attestation_helpers import spawn_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker]


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


class Secrets:
    def __init__(self) -> None:
        self.key = f"gwkey-{uuid.uuid4().hex}-DISTINCT"
        self.token = f"svctok-{uuid.uuid4().hex}-DISTINCT"

    def absent(self, where: str, blob: str | bytes) -> None:
        data = blob if isinstance(blob, bytes) else blob.encode()
        for name, value in (("gateway key", self.key), ("service token", self.token)):
            assert value.encode() not in data, f"the {name} appears in {where}"


def run(client: httpx.Client, job: dict) -> tuple[dict, str]:
    resp = client.post("/v1/jobs", json=job)
    assert resp.status_code == 200, resp.text
    return json.loads(resp.text.strip().splitlines()[-1])["receipt"], resp.text


def check_everywhere(s: Secrets, docker_client, client: httpx.Client, host_id: str, home: Path, image: str,
                     since: int, log: str, streams: list[str], receipts: list[dict], user_id: str,
                     chat_id: str) -> None:
    containers = docker_client.containers.list(all=True, filters={"label": f"org.cloud-agent.host-id={host_id}"})
    assert len(containers) == 1
    container = containers[0]
    container.reload()
    s.absent("the container's config, labels, env or command", json.dumps(container.attrs))
    # Every exec the daemon made: the engine keeps a record only while its process runs (the
    # keeper's start ends once the daemon links to its socket), so its events name each one's
    # command, and the processes it started show their command lines and environments.
    execs = list(docker_client.api.events(since=since, until=int(time.time()) + 1, decode=True,
                                          filters={"container": container.id, "event": "exec_create"}))
    assert execs, "the engine reported no exec of the sandbox"
    for event in execs:
        s.absent(f"exec {event['Actor']['Attributes'].get('execID', '?')[:12]} (exec_create event)", json.dumps(event))
    for exec_id in container.attrs.get("ExecIDs") or []:
        s.absent(f"exec {exec_id[:12]} (exec inspect)", json.dumps(docker_client.api.exec_inspect(exec_id)))
    # the agent's processes (the keeper and the CLI it started); root's come from the container's config
    procs = container.exec_run(["sh", "-c", 'for p in /proc/[0-9]*; do cat "$p/cmdline" "$p/environ"; echo; done'],
                               user="agent").output
    assert b"/usr/local/bin/ca-keeper\x00run\x00" in procs and b"CLOUD_AGENT_CODEX_API_KEY=ca-placeholder-" in procs
    s.absent("a sandbox process's command line or environment", procs)
    img = docker_client.images.get(image)
    s.absent("the image config", json.dumps(img.attrs))
    history = subprocess.run(["docker", "history", "--no-trunc", "--format", "{{json .}}", image],
                             capture_output=True, check=True).stdout
    s.absent("the image layers (docker history)", history)
    s.absent("the daemon's log", log)
    assert '"event": "turn.committed"' in log  # the log really covers the turns
    for text in streams:
        s.absent("a job's NDJSON events", text)
    for r in receipts:
        fetched = client.get(f"/v1/jobs/{r['job_id']}", params={"user_id": r["user_id"]})
        assert fetched.status_code == 200
        s.absent("a receipt", fetched.text)
    s.absent("the chat status", client.get(f"/v1/users/{user_id}/chats/{chat_id}").text)
    s.absent("the attestation document", client.get("/v1/attestation").text)
    for path in home.rglob("*"):
        if path.is_file() and path.name not in ("gateway-key", "token"):
            s.absent(f"the daemon's state file {path.name}", path.read_bytes())
    for root in ("/home/agent", "/tmp"):
        stream, _ = container.get_archive(root)
        s.absent(f"the sandbox's files under {root}", b"".join(stream))


def test_secrets_never_leak(fx, tmp_path, sandbox_image, docker_client) -> None:
    s = Secrets()
    home = tmp_path / "home"
    home.mkdir()
    (home / "gateway-key").write_text(s.key + "\n")
    (home / "token").write_text(s.token + "\n")
    host_id = f"secrets-{uuid.uuid4().hex[:8]}"
    env = {"CLOUD_AGENT_GATEWAY_KEY_FILE": str(home / "gateway-key"),
           "CLOUD_AGENT_SERVICE_TOKEN_FILE": str(home / "token"), "CLOUD_AGENT_GATEWAY_URL": fx.base_url,
           "CLOUD_AGENT_IMAGE": sandbox_image, "CLOUD_AGENT_HOST_ID": host_id}
    chat = Chat("codex")
    fx.add_rules(reject("the gateway refused this request", match="please fail"))
    since = int(time.time()) - 1
    with spawn_daemon(home, env) as d, httpx.Client(base_url=d.url, timeout=300,
                                                    headers={"authorization": f"Bearer {s.token}"}) as client:
        receipts, streams = [], []
        for msg in ("first question", "second question"):
            receipt, text = run(client, chat.job(msg))
            assert receipt["outcome"] == "succeeded", text
            receipts.append(receipt)
            streams.append(text)
        args = (s, docker_client, client, host_id, home, sandbox_image, since)
        check_everywhere(*args, d.log(), streams, receipts, chat.user_id, chat.chat_id)

        # a failing turn (a settled API error) and error answers
        receipt, text = run(client, chat.job("please fail now"))
        assert (receipt["outcome"], receipt["reason"]) == ("failed", "api_error"), text
        receipts.append(receipt)
        streams.append(text)
        errors = [
            client.post("/v1/jobs", json={**chat.job("x"), "runtime": "nope"}),  # 422
            client.post("/v1/jobs", json={**chat.job("other"), "job_id": receipts[0]["job_id"]}),  # 409 conflict
            client.get("/v1/jobs/missing", params={"user_id": chat.user_id}),  # 404
            client.get("/v1/attestation", headers={"authorization": f"Bearer {s.key}"}),  # 401, the key as token
        ]
        assert [e.status_code for e in errors] == [422, 409, 404, 401]
        for e in errors:
            s.absent("an error answer", e.text)
        check_everywhere(*args, d.log(), streams, receipts, chat.user_id, chat.chat_id)

        # not even the CLI's own environment holds the key: the proxy swapped its placeholder
        container = docker_client.containers.get(receipt["sandbox"]["container_id"])
        pids = container.exec_run(["pgrep", "-f", "codex"], user="agent").output.decode().split()
        environs = [container.exec_run(["cat", f"/proc/{p}/environ"], user="agent").output for p in pids]
        assert environs and all(b"CLOUD_AGENT_CODEX_API_KEY=ca-placeholder-" in e for e in environs)
        assert not any(s.key.encode() in e or s.token.encode() in e for e in environs)
        assert {r.credentials.get("authorization") for r in fx.requests() if r.kind != "probe"} == {
            f"Bearer {fingerprint(s.key)}"}
