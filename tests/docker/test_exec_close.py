"""Closing an attached exec hangs up on the engine (the process inside sees its stdin end)."""

from __future__ import annotations

import gc

import anyio
import pytest

from sandbox_manager.engine import DockerEngine
from tests.support.throwaway_container import throwaway_container

pytestmark = [pytest.mark.docker, pytest.mark.anyio]


@pytest.fixture(scope="module")
def container(sandbox_image, docker_client):
    with throwaway_container(sandbox_image, docker_client, prefix="ca-exec-close") as cid:
        yield cid


async def test_aclose_of_an_attached_exec_closes_the_connection(container) -> None:
    """Before the fix the SDK's file object kept the socket open after ``aclose()``: dockerd
    never saw the client go, the exec's stdin stayed open and its output piled up unread,
    until the garbage collector happened to break the SDK's response cycle (so it is held off
    here: the hang-up must not depend on it)."""
    engine = DockerEngine()
    gc.disable()
    try:
        s = await engine.exec_attached(container, ["sh", "-c", "cat; echo gone > /tmp/stdin-closed"])
        with anyio.fail_after(20):
            await s.send(b"ping")
            assert await s.receive() == b"ping"
            await s.aclose()
            while (await engine.exec_run(container, ["cat", "/tmp/stdin-closed"])) != (0, b"gone\n"):
                await anyio.sleep(0.1)
    finally:
        gc.enable()
        engine.close()
