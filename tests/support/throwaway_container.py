"""A hardened throwaway container from the pinned image (network none, init), labelled so the
suite's clean-up finds it, for tests that need a sandbox but not the sandbox manager."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from sandbox_manager.engine import ContainerSpec, DockerEngine
from sandbox_manager.identity import LABEL_HOST, LABEL_SANDBOX
from tests.daemon_harness import TEST_HOST_IDS

HOST_ID = f"engine-test-{uuid.uuid4().hex[:8]}"


@contextmanager
def throwaway_container(image: str, docker_client, prefix: str = "ca-test") -> Iterator[str]:
    TEST_HOST_IDS.add(HOST_ID)
    engine = DockerEngine()
    spec = ContainerSpec(image=image, name=f"{prefix}-{uuid.uuid4().hex[:10]}",
                         labels={LABEL_SANDBOX: "1", LABEL_HOST: HOST_ID})
    info = anyio.run(engine.create, spec)
    try:
        anyio.run(engine.start, info.id)
        attrs = docker_client.api.inspect_container(info.id)
        assert attrs["HostConfig"]["NetworkMode"] == "none" and attrs["HostConfig"]["Init"] is True
        yield info.id
    finally:
        docker_client.api.remove_container(info.id, force=True)
        engine.close()
