"""A sandbox's gate hands the CLI's own TCP connection to the proxy over the model socket
(proxy.sockets.take_handoff): the proxy serves HTTP on it directly, keep-alive included, and
the chat is still the socket it came through. Anything else a sandbox could pass (a pipe, a
listening socket, several descriptors, a descriptor with the wrong byte) is closed, answered
with nothing, leaks no descriptor, and the socket serves the next connection as before."""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import pytest

from deploy.loopback import LoopbackFixture, expected_default_reply
from proxy import DigestEntry
from proxy.sockets import HANDOFF
from tests.support.proxy_harness import Jobs, ListSink, running_proxy

pytestmark = pytest.mark.anyio

CHAT = {"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi over the handoff"}]}


@pytest.fixture
def fx(tmp_path: Path) -> Iterator[LoopbackFixture]:
    with LoopbackFixture.start(record_path=str(tmp_path / "fixture.jsonl")) as f:
        yield f


@contextmanager
def tcp_pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the CLI's end, the accepted end a gate would hand over) of one loopback connection."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=10)
        accepted, _ = listener.accept()
    try:
        yield client, accepted
    finally:
        client.close()
        accepted.close()


def hand_over(path: Path, data: bytes, fds: list[int]) -> bytes:
    """What a gate does (then closes its copies); returns what came back on the unix socket."""
    with socket.socket(socket.AF_UNIX) as unix:
        unix.settimeout(10)
        unix.connect(str(path))
        socket.send_fds(unix, [data], fds)
        out = bytearray()
        while chunk := unix.recv(4096):
            out += chunk
        return bytes(out)


def http_request(sock: socket.socket, body: dict) -> tuple[int, bytes]:
    """One streamed POST on ``sock`` (kept open); the status and the de-chunked body."""
    raw = json.dumps(body).encode()
    sock.sendall(b"POST /m/m1/v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                 b"content-length: %d\r\n\r\n%s" % (len(raw), raw))
    f = sock.makefile("rb")
    status = int(f.readline().split()[1])
    while f.readline() not in (b"\r\n", b""):
        pass
    payload = bytearray()
    while (size := int(f.readline().strip(), 16)) > 0:
        payload += f.read(size)
        f.readline()
    f.readline()
    return status, bytes(payload)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_handed_over_connection_is_served_keep_alive_as_its_chat(fx: LoopbackFixture, tmp_path: Path) -> None:
    sink, jobs = ListSink(), Jobs()
    jobs.running = {("chat-a", "m1"): "job-a"}
    async with running_proxy(fx.base_url, tmp_path, sink=sink, jobs=jobs) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="ua")
        with tcp_pair() as (client, accepted):
            # the proxy closes the unix connection at once: it only carried the descriptor
            assert await anyio.to_thread.run_sync(hand_over, path, HANDOFF, [accepted.fileno()]) == b""
            accepted.close()  # as the gate does: the proxy's copy is the connection now
            first = await anyio.to_thread.run_sync(http_request, client, CHAT)
            second = await anyio.to_thread.run_sync(http_request, client, CHAT)  # the same connection
        await host.flush("chat-a")
    for status, payload in (first, second):
        assert (status, payload.rstrip().endswith(b"data: [DONE]")) == (200, True), payload[-200:]
    reply = [DigestEntry.text("assistant", expected_default_reply(["hi over the handoff"]))]
    assert [(r.chat_key, r.member_key, r.job_id, r.status, r.route, r.reply, r.bytes_out) for r in sink.records] == [
        ("chat-a", "m1", "job-a", 200, "openai.chat", reply, len(first[1])),
        ("chat-a", "m1", "job-a", 200, "openai.chat", reply, len(second[1]))]
    assert len(fx.requests()) == 2


def _pipe() -> list[int]:
    r, w = os.pipe()
    os.close(w)
    return [r]


def _listening() -> list[int]:
    s = socket.create_server(("127.0.0.1", 0))
    return [s.detach()]


def _two() -> list[int]:
    a = socket.create_server(("127.0.0.1", 0))
    b = socket.create_server(("127.0.0.1", 0))
    return [a.detach(), b.detach()]


def _unix_pair() -> list[int]:
    a, b = socket.socketpair()
    b.close()
    return [a.detach()]


@pytest.mark.parametrize("make,data", [(_pipe, HANDOFF), (_listening, HANDOFF), (_two, HANDOFF),
                                       (_unix_pair, HANDOFF)], ids=["pipe", "listening", "two", "unix"])
async def test_anything_but_a_connected_tcp_socket_is_closed_unanswered(fx: LoopbackFixture, tmp_path: Path,
                                                                        make, data: bytes) -> None:
    sink = ListSink()
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="ua")
        before = open_fds()
        fds = make()
        try:
            assert await anyio.to_thread.run_sync(hand_over, path, data, fds) == b""
        finally:
            for fd in fds:
                os.close(fd)
        with anyio.fail_after(5):
            while open_fds() != before:  # the proxy's copies are closed too
                await anyio.sleep(0.01)
        # the socket serves the next connection (a real hand-over) as before
        with tcp_pair() as (client, accepted):
            await anyio.to_thread.run_sync(hand_over, path, HANDOFF, [accepted.fileno()])
            accepted.close()
            status, _ = await anyio.to_thread.run_sync(http_request, client, CHAT)
        await host.flush("chat-a")
    assert status == 200
    assert [r.status for r in sink.records] == [200]


async def test_a_descriptor_with_another_byte_is_not_a_handoff(fx: LoopbackFixture, tmp_path: Path) -> None:
    sink = ListSink()
    async with running_proxy(fx.base_url, tmp_path, sink=sink) as host:
        path = await host.open_sandbox("chat-a", tmp_path / "a", user_id="ua")
        with tcp_pair() as (client, accepted):
            assert await anyio.to_thread.run_sync(hand_over, path, b"P", [accepted.fileno()]) == b""
            accepted.close()
            client.settimeout(5)
            assert client.recv(100) == b""  # closed: the proxy kept nothing of it
    assert sink.records == []
