"""DockerEngine.wait_log_line follows the container's output (the model gate's readiness line,
issue 16): a line written after the wait began is found, lines from before ``since`` are not,
and the wait ends at its bound or as soon as the container's output ends."""

from __future__ import annotations

import time
import uuid

import anyio
import pytest

from sandbox_manager.engine import ContainerSpec, DockerEngine
from sandbox_manager.identity import LABEL_HOST, LABEL_SANDBOX
from tests.daemon_harness import TEST_HOST_IDS

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

HOST_ID = f"log-wait-{uuid.uuid4().hex[:8]}"
SCRIPT = "echo 'old ready'; sleep 1.2; echo 'noise' >&2; echo '{\"event\": \"gate.ready\", \"n\": 2}' >&2; sleep 60"


async def test_a_line_written_during_the_wait_is_found_and_older_ones_are_not(sandbox_image) -> None:
    TEST_HOST_IDS.add(HOST_ID)
    engine = DockerEngine()
    info = await engine.create(ContainerSpec(image=sandbox_image, name=f"ca-log-wait-{uuid.uuid4().hex[:8]}",
                                             labels={LABEL_SANDBOX: "1", LABEL_HOST: HOST_ID},
                                             command=("sh", "-c", SCRIPT)))
    try:
        await engine.start(info.id)
        await anyio.sleep(0.5)
        since = time.time()  # after "old ready", before the gate's line
        assert await engine.wait_log_line(info.id, "ready", since=since, timeout_s=20) == \
            '{"event": "gate.ready", "n": 2}'
        t = time.monotonic()
        assert await engine.wait_log_line(info.id, "never written", since=since, timeout_s=0.5) is None
        assert 0.5 <= time.monotonic() - t < 5
        await engine.stop(info.id, timeout_s=0)
        t = time.monotonic()
        assert await engine.wait_log_line(info.id, "never written", since=since, timeout_s=30) is None
        assert time.monotonic() - t < 5  # the output ended: no waiting out the bound
    finally:
        await engine.remove(info.id)
        engine.close()
