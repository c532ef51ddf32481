"""Sealed sandboxes (SPEC 7, 12): no network of their own, one way out through the chat's
model socket.

The host proxy's per-sandbox directory is mounted read-only at ``MODEL_DIR``, and the
container's command (``ca-modelgate``) forwards ``127.0.0.1:MODEL_PORT`` of the sandbox's
own network namespace to the socket inside it (each accepted connection is handed to the
proxy as a descriptor: see proxy.sockets).
"""

from __future__ import annotations

from sandbox_manager.engine import ContainerInfo, Engine

MODEL_DIR = "/run/cloud-agent/model"
MODEL_SOCKET = f"{MODEL_DIR}/model.sock"
MODEL_PORT = 18080
MODEL_GATE_READY = "modelgate.listening"
MODEL_GATE_COMMAND = ("ca-modelgate", "--socket", MODEL_SOCKET, "--listen", f"127.0.0.1:{MODEL_PORT}")


class ModelGateNotReady(Exception):
    """The container started but its model gate (ca-modelgate) did not report listening."""


def unsealed(info: ContainerInfo, socket_dir: str) -> str | None:
    """Why the container is not sealed (network none, ``socket_dir`` mounted read-only at
    MODEL_DIR), or None. One made before sealing cannot be sealed in place (Docker adds no
    mount and changes no network of an existing container): it is replaced on its volume."""
    network = (info.attrs.get("HostConfig") or {}).get("NetworkMode")
    if network != "none":
        return f"created with network {network!r}"
    mounts = [m for m in info.attrs.get("Mounts") or [] if m.get("Destination") == MODEL_DIR]
    if not mounts or mounts[0].get("Source") != socket_dir or mounts[0].get("RW", True):
        return f"no read-only model socket mount of {socket_dir} at {MODEL_DIR}"
    return None


async def wait_gate(engine: Engine, info: ContainerInfo, *, since: float, timeout_s: float) -> None:
    """Until the container's model gate reports listening (logged since ``since``)."""
    if not await engine.wait_log_line(info.id, MODEL_GATE_READY, since=since, timeout_s=timeout_s):
        raise ModelGateNotReady(f"{info.name}: ca-modelgate did not report listening within {timeout_s}s")
