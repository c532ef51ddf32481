"""Sealed test containers: what the product does for a sandbox, for tests that run a CLI in a
container of their own (driver suites, harnesses, benchmarks).

The container has no network (``network_mode="none"``, SPEC 7: never host networking, not in
tests either); its command is ``ca-modelgate``, which forwards 127.0.0.1:18080 inside it to a
unix socket in a host directory mounted read-only. A :class:`proxy.ProxyHost` in the test
process listens on that socket and forwards to the test's loopback fixture with the real key;
the CLI is configured with ``gateway(...)``: the member prefix and the placeholder key.

    volumes = {**sealed_volumes(socket_dir), ...}
    c = docker_client.containers.run(image, MODELGATE_COMMAND, network_mode="none", volumes=volumes, ...)
    async with sealed_proxy(fx.base_url, socket_dir, key="sk-test") as gate:
        gateway = gate.gateway(model="fixture-model")
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from deploy.loopback import LoopbackFixture
from drivers.models import GatewayConfig
from proxy import ProxyConfig, ProxyHost, member_base_url, placeholder_key
from sandbox_manager.sealing import MODEL_DIR, MODEL_GATE_COMMAND, MODEL_PORT

MODELGATE_COMMAND = list(MODEL_GATE_COMMAND)
CHAT_KEY = "test-sandbox"


def sealed_volumes(socket_dir: Path) -> dict[str, dict[str, str]]:
    socket_dir.mkdir(parents=True, exist_ok=True)
    socket_dir.chmod(0o755)
    return {str(socket_dir): {"bind": MODEL_DIR, "mode": "ro"}}


def docker_run_args(socket_dir: Path) -> list[str]:
    """``docker run`` flags of a sealed container (put the image, then MODELGATE_COMMAND, after)."""
    sealed_volumes(socket_dir)
    return ["--network", "none", "-v", f"{socket_dir}:{MODEL_DIR}:ro"]


@dataclass
class SealedGate:
    host: ProxyHost
    chat_key: str

    def gateway(self, *, model: str, member: str = "m1") -> GatewayConfig:
        return GatewayConfig(base_url=member_base_url(MODEL_PORT, member), key=SecretStr(placeholder_key(self.chat_key)),
                             model=model)


@asynccontextmanager
async def sealed_proxy(upstream_url: str, socket_dir: Path, *, key: str,
                       chat_key: str = CHAT_KEY) -> AsyncIterator[SealedGate]:
    """A model proxy on ``socket_dir/model.sock`` in front of ``upstream_url`` holding ``key``."""
    with tempfile.TemporaryDirectory(prefix="ca-key-") as tmp:
        key_file = Path(tmp) / "key"
        key_file.write_text(key + "\n")
        async with ProxyHost(ProxyConfig(upstream_url=upstream_url, key_file=key_file)) as host:
            await host.open_sandbox(chat_key, socket_dir, user_id="test-user")
            yield SealedGate(host, chat_key)


@asynccontextmanager
async def sealed_fixture(socket_dir: Path, key: str) -> AsyncIterator[tuple[LoopbackFixture, SealedGate]]:
    """A loopback fixture and a model proxy in front of it on ``socket_dir/model.sock``."""
    with LoopbackFixture.start(port=0) as fx:
        async with sealed_proxy(fx.base_url, socket_dir, key=key) as gate:
            yield fx, gate


class ThreadedProxy:
    """``sealed_proxy`` on an event loop of its own thread, for synchronous harnesses:
    ``with ThreadedProxy(fx.base_url, socket_dir, key=...) as gate: ...``."""

    def __init__(self, upstream_url: str, socket_dir: Path, *, key: str) -> None:
        self.args = (upstream_url, socket_dir, key)
        self.gate: SealedGate | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="sealed-proxy", daemon=True)

    def _run(self) -> None:
        async def serve() -> None:
            upstream, socket_dir, key = self.args
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            async with sealed_proxy(upstream, socket_dir, key=key) as gate:
                self.gate = gate
                self._ready.set()
                await self._stop.wait()

        try:
            asyncio.run(serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the starter
            self._error = exc
        finally:
            self._ready.set()

    def __enter__(self) -> SealedGate:
        self._thread.start()
        self._ready.wait(30)
        if self.gate is None:
            raise RuntimeError(f"the model proxy did not start: {self._error!r}")
        return self.gate

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
