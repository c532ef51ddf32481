"""Test support for the model proxy: an in-memory sink, a running proxy host, raw clients."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx

from proxy import ProxyConfig, ProxyHost, WireRecord

REAL_KEY = "sk-real-gateway-key-7f3a9c1e5b"


class ListSink:
    """Records in memory, in the order the proxy put them."""

    def __init__(self) -> None:
        self.records: list[WireRecord] = []

    async def put(self, record: WireRecord) -> None:
        self.records.append(record)

    def for_chat(self, chat_key: str) -> list[WireRecord]:
        return [r for r in self.records if r.chat_key == chat_key]


class Jobs:
    """The runner's turn lookup: (chat_key, member_key) -> running job id."""

    def __init__(self) -> None:
        self.running: dict[tuple[str, str], str] = {}

    def __call__(self, chat_key: str, member_key: str) -> str | None:
        return self.running.get((chat_key, member_key))


def key_file(directory: Path, key: str = REAL_KEY) -> Path:
    path = directory / "gateway.key"
    path.write_text(key + "\n")
    path.chmod(0o600)
    return path


@asynccontextmanager
async def running_proxy(upstream_url: str, directory: Path, *, sink: ListSink | None = None, jobs: Jobs | None = None,
                        **config: Any) -> AsyncIterator[ProxyHost]:
    cfg = ProxyConfig(upstream_url=upstream_url, key_file=key_file(directory), **config)
    async with ProxyHost(cfg, sink=sink, turn_of=jobs) as host:
        yield host


def uds_client(path: Path, **kw: Any) -> httpx.AsyncClient:
    """A sandbox-side client: HTTP over the sandbox's model socket."""
    return httpx.AsyncClient(transport=httpx.AsyncHTTPTransport(uds=str(path)), base_url="http://127.0.0.1:18080",
                             timeout=kw.pop("timeout", 30), **kw)


async def raw_exchange(path: Path, data: bytes, *, timeout: float = 10.0) -> bytes:
    """Send raw bytes on a fresh connection and read until the proxy closes it."""
    out = bytearray()
    with anyio.fail_after(timeout):
        async with await anyio.connect_unix(str(path)) as stream:
            await stream.send(data)
            while True:
                try:
                    out += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    return bytes(out)
