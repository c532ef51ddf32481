"""A sealed sandbox (network_mode none) of the pinned image reaches the model only through its
socket: ca-modelgate (the container's command) forwards 127.0.0.1:18080 to the model socket,
bind-mounted read-only; the host's model proxy forwards to the loopback fixture with the real
key. Nothing else on the host is reachable, and the socket comes back at the same path after
the proxy restarts while a request waits."""

from __future__ import annotations

import json
import shlex
import shutil
import socket
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from deploy.loopback import LoopbackFixture, expected_default_reply
from deploy.loopback.recorder import fingerprint
from proxy import DigestEntry, member_base_url, placeholder_key
from tests.support.proxy_harness import REAL_KEY, ListSink, running_proxy

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

MOUNT = "/run/cloud-agent/model"
PORT = 18080
CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "from inside the sandbox"}]}


@pytest.fixture
def root() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ca-proxy-", dir="/var/tmp"))
    path.chmod(0o700)  # host-side: only root; the container sees just the mounted socket directory
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fx() -> Iterator[LoopbackFixture]:
    with LoopbackFixture.start() as f:
        yield f


@pytest.fixture
def sandbox(docker_client: Any, sandbox_image: str, root: Path) -> Iterator[Any]:
    socket_dir = root / "sockets" / "chat-a"
    socket_dir.mkdir(parents=True)
    c = docker_client.containers.run(
        sandbox_image, ["ca-modelgate", "--socket", f"{MOUNT}/model.sock", "--listen", f"127.0.0.1:{PORT}",
                        "--connect-timeout", "30"],
        detach=True, init=True, network_mode="none", user="agent", cap_drop=["ALL"],
        security_opt=["no-new-privileges"], volumes={str(socket_dir): {"bind": MOUNT, "mode": "ro"}},
        labels={"cloud-agent.test": f"proxy-sealed-{uuid.uuid4().hex[:8]}"})
    c.socket_dir = socket_dir
    try:
        # the container is up before its command listens: wait for ca-modelgate's first line
        for line in c.logs(stream=True, stderr=True, stdout=False, follow=True):
            assert b"modelgate.listening" in line, line
            break
        yield c
    finally:
        c.remove(force=True)


async def run(container: Any, script: str, timeout: float = 60) -> tuple[int, str]:
    def go() -> tuple[int, str]:
        rc, out = container.exec_run(["sh", "-c", script], user="agent", demux=False)
        return rc, out.decode(errors="replace")

    with anyio.fail_after(timeout):
        return await anyio.to_thread.run_sync(go)


def curl_chat(member: str = "m1") -> str:
    url = member_base_url(PORT, member) + "/v1/chat/completions"
    return (f"curl -sS -N --retry 0 -H 'content-type: application/json' -H 'authorization: Bearer "
            f"{placeholder_key('chat-a')}' -d {shlex.quote(json.dumps(CHAT))} {url}")


async def test_a_sealed_sandbox_reaches_the_model_only_through_its_socket(
        sandbox: Any, fx: LoopbackFixture, root: Path) -> None:
    sink = ListSink()
    async with running_proxy(fx.base_url, root, sink=sink) as host:
        await host.open_sandbox("chat-a", sandbox.socket_dir, user_id="u1")
        rc, out = await run(sandbox, curl_chat())
        assert rc == 0, out
        assert out.rstrip().endswith("data: [DONE]"), out
        # python inside the sandbox, reading the stream as it comes (stdlib http.client)
        py = (f"import http.client, json; c = http.client.HTTPConnection('127.0.0.1', {PORT}); "
              "c.request('POST', '/m/m2/v1/messages', body=json.dumps({'model': 'm', 'stream': True, "
              "'messages': [{'role': 'user', 'content': 'hi'}]}), headers={'x-api-key': 'placeholder'}); "
              "r = c.getresponse(); print(r.status, r.getheader('content-type')); "
              "print(r.readline().decode().strip())")
        rc, out = await run(sandbox, f"python3 -c {shlex.quote(py)}")
        assert (rc, out.splitlines()) == (0, ["200 text/event-stream; charset=utf-8", "event: message_start"]), out
        # the proxy's 403 reaches the sandbox; the fixture's control routes do not
        rc, out = await run(sandbox, f"curl -sS -o /dev/null -w '%{{http_code}}' -X POST "
                                     f"http://127.0.0.1:{PORT}/m/m1/_fixture/reset")
        assert (rc, out) == (0, "403"), out
        await host.flush("chat-a")
    conversation = [r for r in fx.requests() if r.path == "/v1/chat/completions"]
    assert len(conversation) == 1
    assert conversation[0].credentials == {"authorization": "Bearer " + fingerprint(REAL_KEY)}
    assert [(r.chat_key, r.member_key, r.status) for r in sink.records] == [
        ("chat-a", "m1", 200), ("chat-a", "m2", 200), ("chat-a", "m1", 403)]
    assert sink.records[0].reply == [DigestEntry.text("assistant", expected_default_reply([
        "from inside the sandbox"]))]


async def test_nothing_else_is_reachable_and_the_mount_is_read_only(sandbox: Any, fx: LoopbackFixture) -> None:
    host_addresses = sorted({info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
                             if not info[4][0].startswith("127.")})
    probe = ("import socket, sys\n"
             "for host, port in [(h, int(p)) for h, p in (a.split(':') for a in sys.argv[1:])]:\n"
             "    try:\n"
             "        socket.create_connection((host, port), timeout=3).close(); print(host, port, 'open')\n"
             "    except OSError as e:\n"
             "        print(host, port, type(e).__name__)\n")
    targets = [f"127.0.0.1:{fx.port}", "127.0.0.1:22", *(f"{a}:{fx.port}" for a in host_addresses)]
    rc, out = await run(sandbox, f"python3 -c {shlex.quote(probe)} {' '.join(targets)}")
    assert rc == 0, out
    lines = out.splitlines()
    assert len(lines) == len(targets) and not [line for line in lines if line.endswith(" open")], out
    interfaces = "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '; wc -l < /proc/net/route"
    rc, out = await run(sandbox, interfaces)
    assert out.split() == ["lo", "1"], out  # only loopback, and no route (the header line alone)
    rc, out = await run(sandbox, f"touch {MOUNT}/x 2>&1; ls -A {MOUNT}")
    assert "Read-only file system" in out, out


async def test_the_socket_comes_back_at_the_same_path_while_a_request_waits(
        sandbox: Any, fx: LoopbackFixture, root: Path) -> None:
    """The daemon restarts: the socket is gone, a CLI's request waits in ca-modelgate, and the
    next proxy process opens the same path; the request then succeeds (SPEC 14)."""
    async with running_proxy(fx.base_url, root) as host:
        await host.open_sandbox("chat-a", sandbox.socket_dir, user_id="u1")
        assert (await run(sandbox, curl_chat()))[0] == 0
    assert not (sandbox.socket_dir / "model.sock").exists()
    results: list[tuple[int, str]] = []
    async with anyio.create_task_group() as tg:
        async def waiting_request() -> None:
            results.append(await run(sandbox, curl_chat()))

        tg.start_soon(waiting_request)
        with anyio.fail_after(30):  # curl is connected to ca-modelgate, which waits for the socket
            while (await run(sandbox, f"grep -c ':{PORT:04X} [0-9A-F:]* 01 ' /proc/net/tcp"))[1].strip() in ("", "0"):
                pass
        assert results == []
        async with running_proxy(fx.base_url, root) as host:
            await host.open_sandbox("chat-a", sandbox.socket_dir, user_id="u1")
            with anyio.fail_after(30):
                while not results:
                    await anyio.sleep(0.05)
    [(rc, out)] = results
    assert rc == 0 and out.rstrip().endswith("data: [DONE]"), out
    assert len([r for r in fx.requests() if r.path == "/v1/chat/completions"]) == 2
