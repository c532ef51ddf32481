"""Runtime name -> driver: one line per CLI (the driver's package is imported on first use)."""

from __future__ import annotations

from importlib import import_module
from typing import Any

from drivers.base import Driver
from drivers.models import DriverOptions

# runtime -> (module, class, constructor arguments)
_DRIVERS: dict[str, tuple[str, str, tuple[Any, ...]]] = {
    "claude": ("drivers.claude", "ClaudeDriver", ()),
    "codex": ("drivers.codex", "CodexDriver", ()),
    "pi": ("drivers.pi", "PiDriver", ()),
    "opencode": ("drivers.bridge", "BridgeDriver", ("opencode",)),
    "kilo": ("drivers.bridge", "BridgeDriver", ("kilo",)),
}
RUNTIMES = tuple(_DRIVERS)


def get_driver(runtime: str, options: DriverOptions | None = None) -> Driver:
    """The driver of ``runtime``, given the launch inputs every driver takes (``options``)."""
    try:
        module, name, args = _DRIVERS[runtime]
    except KeyError:
        raise KeyError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}") from None
    driver: Driver = getattr(import_module(module), name)(*args, options=options)
    return driver
