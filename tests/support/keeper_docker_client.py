"""A stand-in daemon for the kill -9 test: starts a keeper in a container through the
engine seam (one attached exec), reads, acknowledges, reports, then waits to be killed.

    python -m tests.support.keeper_docker_client CONTAINER_ID ARGV_JSON N_READ N_ACK
"""

from __future__ import annotations

import json
import sys

import anyio

from sandbox_manager import keeper_sandbox
from sandbox_manager.engine import DockerEngine


async def main(container_id: str, argv: list[str], n_read: int, n_ack: int) -> None:
    engine = DockerEngine()
    ch = await keeper_sandbox.start(engine, container_id, argv)
    ready = await ch.receive()
    await ch.send(b'{"op":"emit","n":20000,"size":50,"tag":"k9"}')
    offsets = []
    for _ in range(n_read):
        await ch.receive()
        offsets.append(ch.offset)
    await ch.ack(offsets[n_ack - 1])
    print(json.dumps({"identity": ch.identity.model_dump(), "acked": ch.acked, "read": ch.offset,
                      "ready": ready.decode()}), flush=True)
    await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
