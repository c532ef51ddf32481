"""DockerEngine's inspect reads straight on the engine's socket (sandbox_manager.engine_reads)
read what the SDK reads, against the real engine: a container (created and running), the
image, a volume, the data root's marker; and a missing one of each is NotFound."""

from __future__ import annotations

import uuid

import docker
import pytest

from sandbox_manager.engine import DATA_ROOT_LABEL, DATA_ROOT_VOLUME, ContainerSpec, DockerEngine, NotFound
from sandbox_manager.engine_types import container_info
from sandbox_manager.identity import LABEL_HOST, LABEL_SANDBOX
from tests.daemon_harness import TEST_HOST_IDS

pytestmark = [pytest.mark.docker, pytest.mark.anyio]

HOST_ID = f"engine-reads-{uuid.uuid4().hex[:8]}"


async def test_inspect_reads_equal_the_sdks(sandbox_image, docker_client: docker.DockerClient) -> None:
    TEST_HOST_IDS.add(HOST_ID)
    engine = DockerEngine()
    name = f"ca-engine-reads-{uuid.uuid4().hex[:8]}"
    vol = docker_client.volumes.create(f"{name}-vol", labels={"org.cloud-agent.test": name})
    info = await engine.create(ContainerSpec(image=sandbox_image, name=name, command=("sleep", "60"),
                                             labels={LABEL_SANDBOX: "1", LABEL_HOST: HOST_ID}))
    try:
        for step in ("created", "running"):
            if step == "running":
                await engine.start(info.id)
            got = await engine.inspect(info.id)
            want = container_info(docker_client.containers.get(info.id).attrs)  # the SDK's own read
            assert got == want and (got.name, got.status) == (name, step)
            assert await engine.inspect(name) == got  # by name as by id
        image = await engine.image(sandbox_image)
        sdk_image = docker_client.images.get(sandbox_image)
        assert (image.id, image.labels, list(image.tags)) == (sdk_image.id, sdk_image.labels, sdk_image.tags)
        volume = await engine.inspect_volume(vol.name)
        assert (volume.name, volume.labels) == (vol.name, {"org.cloud-agent.test": name})
        marker = docker_client.volumes.get(DATA_ROOT_VOLUME).attrs["Labels"][DATA_ROOT_LABEL]
        assert await engine.data_root_identity(create=False) == marker
        for missing in (engine.inspect(f"{name}-absent"), engine.image(f"{sandbox_image}-absent"),
                        engine.inspect_volume(f"{name}-absent")):
            with pytest.raises(NotFound):
                await missing
    finally:
        docker_client.api.remove_container(info.id, force=True)
        vol.remove()
