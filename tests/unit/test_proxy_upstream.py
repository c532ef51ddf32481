"""The proxy's upstream client (proxy/upstream.py) against real servers on 127.0.0.1: keep-alive
reuse, a pooled connection the server closed, an answer cut short, silence, HTTPS."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from deploy.loopback import LoopbackFixture, cut
from proxy.upstream import Timeouts, Upstream, UpstreamBrokeOff, UpstreamTimeout, UpstreamUnreachable
from tests.support.proxy_harness import ListSink, running_proxy, uds_client

pytestmark = pytest.mark.anyio

CHAT = json.dumps({"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
HEADERS = [("content-type", "application/json"), ("content-length", str(len(CHAT)))]


async def read_all(resp) -> bytes:
    out = bytearray()
    while (chunk := await resp.next_chunk()) is not None:
        out += chunk
    await resp.aclose()
    return bytes(out)


class OneShotServer:
    """Answers each connection's first request with keep-alive, then closes it (a server whose
    idle timeout fired); counts connections. With ``silent`` it never answers."""

    def __init__(self, *, silent: bool = False, tls: ssl.SSLContext | None = None) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self.silent, self.tls = silent, tls
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._one, args=(conn,), daemon=True).start()

    def _one(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            data = b""
            while b"\r\n\r\n" not in data:
                data += conn.recv(65536)
            if self.silent:
                conn.recv(1)  # until the client gives up
                return
            body = b"hello %d" % self.connections
            conn.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\nx-request-id: r%d\r\n\r\n%s"
                         % (len(body), self.connections, body))
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


async def test_keep_alive_reuses_one_connection() -> None:
    with LoopbackFixture.start() as fx:
        async with Upstream(fx.base_url) as up:
            for _ in range(3):
                resp = await up.send("POST", "/v1/chat/completions", HEADERS, CHAT)
                assert resp.status == 200 and resp.header(b"x-request-id") is not None
                assert (await read_all(resp)).rstrip().endswith(b"data: [DONE]")
            assert len(up._idle) == 1  # noqa: SLF001 - one pooled connection served all three


async def test_a_pooled_connection_the_server_closed_is_replaced() -> None:
    server = OneShotServer()
    try:
        async with Upstream(f"http://127.0.0.1:{server.port}") as up:
            first = await up.send("GET", "/v1/models", [], b"")
            assert await read_all(first) == b"hello 1"
            with anyio.fail_after(5):
                while not up._idle[0].looks_closed():  # noqa: SLF001 - the server's close has arrived
                    await anyio.sleep(0.01)
            second = await up.send("GET", "/v1/models", [], b"")
            assert (second.status, await read_all(second)) == (200, b"hello 2")
    finally:
        server.close()
    assert server.connections == 2


async def test_an_answer_cut_short_is_broke_off_and_not_pooled() -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rule(cut(after_deltas=1, abort=True))
        async with Upstream(fx.base_url) as up:
            resp = await up.send("POST", "/v1/chat/completions", HEADERS, CHAT)
            assert resp.status == 200
            with pytest.raises(UpstreamBrokeOff):
                await read_all(resp)
            await resp.aclose()
            assert up._idle == []  # noqa: SLF001


async def test_silence_is_a_timeout_and_the_proxy_answers_504(tmp_path: Path) -> None:
    server = OneShotServer(silent=True)
    try:
        async with Upstream(f"http://127.0.0.1:{server.port}", timeouts=Timeouts(read_s=0.3)) as up:
            with pytest.raises(UpstreamTimeout, match="did not answer within 0.3s"):
                await up.send("POST", "/v1/chat/completions", HEADERS, CHAT)
        async with running_proxy(f"http://127.0.0.1:{server.port}", tmp_path, sink=(sink := ListSink()),
                                 upstream_read_timeout_s=0.3) as host:
            path = await host.open_sandbox("c", tmp_path / "a", user_id="u")
            async with uds_client(path) as client:
                r = await client.post("/m/m1/v1/chat/completions", content=CHAT)
    finally:
        server.close()
    assert (r.status_code, r.json()["error"]["type"]) == (504, "upstream_timeout")
    assert [(x.status, x.error) for x in sink.records] == [(504, "upstream_timeout")]


async def test_the_proxy_passes_a_cut_stream_on_as_a_cut_stream(tmp_path: Path) -> None:
    with LoopbackFixture.start() as fx:
        fx.add_rule(cut(after_deltas=1, abort=True))
        async with running_proxy(fx.base_url, tmp_path, sink=(sink := ListSink())) as host:
            path = await host.open_sandbox("c", tmp_path / "a", user_id="u")
            async with uds_client(path) as client:
                with pytest.raises(httpx.RemoteProtocolError):
                    await client.post("/m/m1/v1/chat/completions", content=CHAT)
            await host.flush("c")
    [rec] = sink.records
    assert rec.status == 200 and (rec.error or "").startswith("upstream_broke_off") and rec.reply is None


@pytest.fixture
def tls_contexts(tmp_path: Path) -> Iterator[tuple[ssl.SSLContext, ssl.SSLContext]]:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    yield server, client


async def test_https_gateway(tls_contexts: tuple[ssl.SSLContext, ssl.SSLContext]) -> None:
    server_ctx, client_ctx = tls_contexts
    server = OneShotServer(tls=server_ctx)
    try:
        async with Upstream(f"https://127.0.0.1:{server.port}/base", tls_context=client_ctx) as up:
            resp = await up.send("GET", "/v1/models", [], b"")
            assert (resp.status, resp.header(b"x-request-id"), await read_all(resp)) == (200, "r1", b"hello 1")
        # the default context does not trust a self-signed gateway
        async with Upstream(f"https://127.0.0.1:{server.port}") as up:
            with pytest.raises(UpstreamUnreachable, match="SSL"):
                await up.send("GET", "/v1/models", [], b"")
    finally:
        server.close()


async def test_an_answer_that_arrives_in_one_read_goes_to_the_sandbox_in_one_write(tmp_path: Path, monkeypatch) -> None:
    """The head, the body bytes that came with it and the end are held and written together: one
    wake-up of the sandbox's reader, not three (a streamed answer still flushes before every read
    of the upstream: test_sse_streams_through_chunk_by_chunk)."""
    from proxy.sockets import SocketStream

    writes: list[bytes] = []
    real_send = SocketStream.send

    async def counting_send(self, item: bytes) -> None:
        writes.append(bytes(item))
        await real_send(self, item)

    server = OneShotServer()
    try:
        async with running_proxy(f"http://127.0.0.1:{server.port}", tmp_path, sink=ListSink()) as host:
            path = await host.open_sandbox("c", tmp_path / "a", user_id="u")
            monkeypatch.setattr(SocketStream, "send", counting_send)
            async with uds_client(path) as client:
                r = await client.post("/m/m1/v1/chat/completions", content=CHAT)
            monkeypatch.undo()
            await host.flush("c")
    finally:
        server.close()
    assert (r.status_code, r.content) == (200, b"hello 1")
    [answer] = [w for w in writes if w.startswith(b"HTTP/1.1 200")]
    assert answer.endswith(b"\r\n\r\nhello 1")
    assert len([w for w in writes if b"hello 1" in w or w.startswith(b"HTTP/")]) == 1
