"""Sealed sandboxes (SPEC 7, 12): no network of their own, one way out through the chat's
model socket.

The host proxy's per-sandbox directory is mounted read-only at ``MODEL_DIR``, and the
container's command (``ca-modelgate``) forwards ``127.0.0.1:MODEL_PORT`` of the sandbox's
own network namespace to the socket inside it (each accepted connection is handed to the
proxy as a descriptor: see proxy.sockets).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from sandbox_manager.engine import ContainerInfo, Engine
from sandbox_manager.volumes import MARKER_PATH

MODEL_DIR = "/run/cloud-agent/model"
MODEL_SOCKET = f"{MODEL_DIR}/model.sock"
MODEL_PORT = 18080
MODEL_LISTEN = f"127.0.0.1:{MODEL_PORT}"
MODEL_GATE_READY = "modelgate.listening"
# --marker: the listening line carries the state volume's identity marker (GateReport)
MODEL_GATE_COMMAND = ("ca-modelgate", "--socket", MODEL_SOCKET, "--listen", MODEL_LISTEN, "--marker", MARKER_PATH)


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


@dataclass(frozen=True)
class GateReport:
    """What the model gate's listening line says about the state volume. The gate is the
    container's command: it read the marker before anything else ran in this start.
    ``carries_marker`` False: a gate started without ``--marker`` (a container made before it),
    whose volume must be checked another way."""

    carries_marker: bool
    marker: bytes | None = None  # the marker file's text; None when there is none

    @classmethod
    def parse(cls, line: str) -> GateReport:
        try:
            said = json.loads(line[line.index("{"):])
        except ValueError:
            return cls(carries_marker=False)
        if not isinstance(said, dict) or "marker" not in said:
            return cls(carries_marker=False)
        text = said["marker"]
        return cls(carries_marker=True, marker=text.encode() if isinstance(text, str) else None)


async def wait_gate(engine: Engine, info: ContainerInfo, *, since: float, timeout_s: float) -> GateReport:
    """Until the container's model gate reports listening (logged since ``since``): its report."""
    line = await engine.wait_log_line(info.id, MODEL_GATE_READY, since=since, timeout_s=timeout_s)
    if line is None:
        raise ModelGateNotReady(f"{info.name}: ca-modelgate did not report listening within {timeout_s}s")
    return GateReport.parse(line)
