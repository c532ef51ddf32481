"""Request bounds on the real daemon (uvicorn, raw sockets): a too-large body is answered
413 before it is sent, a chunked one as soon as it passes the limit; deep nesting is 422."""

from __future__ import annotations

import json
import select
import socket

import anyio
import pytest

from deploy.loopback import LoopbackFixture
from tests.daemon_harness import TOKEN, daemon_settings, running_daemon

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

LIMIT = 64 * 1024


def request_head(port: int, extra: str) -> bytes:
    return (f"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\n{extra}\r\n").encode()


def read_answer(sock: socket.socket, data: bytes = b"") -> tuple[int, dict[str, str], bytes]:
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines[1:])}
    while len(body) < int(headers.get("content-length", "0")):
        body += sock.recv(65536)
    return int(lines[0].split()[1]), headers, body


def declared_too_large(port: int) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_head(port, "Content-Length: 1000000000\r\n"))  # and not one byte of body
        return read_answer(sock)


def chunked_until_answered(port: int) -> tuple[int, bytes, int]:
    """Send 4 KiB chunks (up to 100 MiB) until the daemon answers; returns (status, body, bytes sent)."""
    sent = 0
    piece = b"x" * 4096
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_head(port, "Transfer-Encoding: chunked\r\n"))
        while sent < 100 * 1024 * 1024:
            readable, _, _ = select.select([sock], [], [], 0.002)
            if readable:
                break
            try:
                sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += len(piece)
        status, _, body = read_answer(sock)
    return status, body, sent


async def test_bodies_are_bounded_before_they_are_read(tmp_path, sandbox_image) -> None:
    with LoopbackFixture.start() as fx:
        settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, max_body_bytes=LIMIT)
        async with running_daemon(settings) as d:
            port = int(d.url.rsplit(":", 1)[1])
            status, headers, body = await anyio.to_thread.run_sync(declared_too_large, port)
            assert (status, json.loads(body)) == (413, {"error": "body_too_large",
                                                        "detail": {"field": "body", "limit_bytes": LIMIT}})
            status, body, sent = await anyio.to_thread.run_sync(chunked_until_answered, port)
            assert (status, json.loads(body)["error"]) == (413, "body_too_large")
            # answered once the limit was passed, not after the 100 MiB the client would send
            assert LIMIT < sent < 4 * 1024 * 1024, sent
            depth = 20_000  # 40 KB: under the limit, far past what json.loads can recurse
            resp = await d.client.post("/v1/jobs", content=b"[" * depth + b"]" * depth)
            assert resp.status_code == 422
            assert resp.json()["detail"] == [{"field": "body", "type": "json_too_deep",
                                              "message": f"nested {depth} levels deep; at most 16 allowed"}]
            assert (await d.client.get("/healthz")).status_code == 200  # still serving
