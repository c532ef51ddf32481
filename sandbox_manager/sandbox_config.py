"""What this host's sandboxes are made with: the configured image, the resource bounds, the
host id every label carries, and the waits of the gate and of a replacement."""

from __future__ import annotations

from dataclasses import dataclass

from images.pins import Pins, load_pins


@dataclass(frozen=True)
class SandboxConfig:
    image: str
    socket_root: str | None = None  # host dir of the per-sandbox model socket dirs (HOME/sockets)
    host_id: str = "local"
    memory_bytes: int = 4 * 1024**3
    pids_limit: int = 1024
    nano_cpus: int = 2_000_000_000
    require_helper: bool = True
    gate_ready_timeout_s: float = 20.0
    disk_bytes: int | None = None  # per-sandbox disk bound (quota where supported, else measured)
    pins: Pins | None = None  # what the configured image must carry (None: images/pins.toml)
    replace_wait_s: float = 900.0  # a replacement waits this long for turns on the old container

    @property
    def pinned(self) -> Pins:
        return self.pins or load_pins()
