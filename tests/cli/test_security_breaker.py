"""A dead optional dependency (the control-plane heartbeat URL) never starves turns: with the
endpoint accepting and never answering, or refusing, the breaker opens, beats fail fast, and
16 concurrent Codex turns in 16 chats all succeed within a bound."""

from __future__ import annotations

import math
import socket
import threading
import time
import uuid

import anyio
import pytest

from deploy.loopback import LoopbackFixture
from tests.cli.attestation_helpers import wait_ready
from tests.daemon_harness import daemon_settings, running_daemon
from tests.supervisor_helpers import Chat

pytestmark = [pytest.mark.cli, pytest.mark.docker, pytest.mark.anyio]

TURNS = 16
TURN_BOUND_S = 45.0  # 16 fresh sandboxes + Codex starts + one turn each, all at once (~5 s measured)
MODEL_TURN_BOUND_MS = 10_000  # the model-turn part of each receipt (~0.2-1.2 s measured)
INTERVAL_S, TIMEOUT_S, FAILURES, RESET_S = 0.1, 0.5, 2, 1.0


@pytest.fixture
def fx():
    with LoopbackFixture.start() as fixture:
        yield fixture


class Blackhole:
    """Accepts connections and never answers (holds them until closed)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.accepted.append(conn)
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self) -> None:
        self._stop.set()
        self._t.join()
        for c in self.accepted:
            c.close()
        self.sock.close()


def refused_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: connecting is refused


@pytest.mark.parametrize("endpoint", ["accepts_never_answers", "refuses"])
async def test_a_dead_control_plane_never_starves_turns(endpoint, fx, tmp_path, sandbox_image) -> None:
    hole = Blackhole() if endpoint == "accepts_never_answers" else None
    port = hole.port if hole else refused_port()
    settings = daemon_settings(tmp_path / "home", fx.base_url, sandbox_image, host_id=f"brk-{uuid.uuid4().hex[:8]}",
                               control_plane_url=f"http://127.0.0.1:{port}/v1/heartbeat",
                               heartbeat_interval_s=INTERVAL_S, control_plane_timeout_s=TIMEOUT_S,
                               breaker_failures=FAILURES, breaker_reset_s=RESET_S)
    try:
        async with running_daemon(settings) as d:
            started = time.monotonic()
            assert (await wait_ready(d.client))["ready"] is True  # an optional dependency is not readiness

            async def control_plane() -> dict:
                return (await d.client.get("/v1/attestation")).json()["dependencies"]["control_plane"]

            with anyio.fail_after(10):
                while (await control_plane())["circuit"]["state"] == "closed":
                    await anyio.sleep(0.05)

            chats = [Chat("codex") for _ in range(TURNS)]
            receipts: list[dict] = []
            states: set[str] = set()

            async def turn(chat: Chat) -> None:
                receipt, events, _ = await d.run(chat.job("hello while the control plane is dead"))
                assert receipt is not None and receipt["outcome"] == "succeeded", events
                receipts.append(receipt)

            async def watch() -> None:
                while len(receipts) < TURNS:
                    cp = await control_plane()
                    states.add(cp["circuit"]["state"])
                    hb = (await d.client.get("/v1/attestation")).json()["heartbeat"]
                    assert hb["age_s"] < 1.0, hb  # the local beat never waits on the dead endpoint
                    await anyio.sleep(0.1)

            t0 = time.monotonic()
            with anyio.fail_after(TURN_BOUND_S):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    for chat in chats:
                        tg.start_soon(turn, chat)
            elapsed = time.monotonic() - t0
            assert len(receipts) == TURNS and {r["context_status"] for r in receipts} == {"NEW"}
            assert len({r["sandbox"]["container_id"] for r in receipts}) == TURNS
            assert max(r["timings_ms"]["turn"] for r in receipts) < MODEL_TURN_BOUND_MS
            assert states <= {"open", "half_open"} and "open" in states

            cp = await control_plane()
            circuit = cp["circuit"]
            alive_s = time.monotonic() - started + 3  # + the daemon's start-up before `started`
            # without the breaker every beat would be a call: alive_s / INTERVAL_S of them
            bound = math.ceil(TIMEOUT_S / INTERVAL_S) + 2 + math.ceil(alive_s / RESET_S) + 1
            assert circuit["state"] in ("open", "half_open")
            assert circuit["admitted"] <= bound < alive_s / INTERVAL_S / 2, (circuit, alive_s)
            assert cp["sent"] == 0 and cp["failed"] >= FAILURES and cp["fast_failed"] >= elapsed / INTERVAL_S / 2
            assert circuit["rejected"] == cp["fast_failed"]
            if hole is not None:
                assert 1 <= len(hole.accepted) <= circuit["admitted"]
                assert circuit["last_error"].startswith(("TimeoutError", "ReadTimeout"))
            else:
                assert circuit["last_error"].startswith("ConnectError")
    finally:
        if hole is not None:
            hole.close()
