"""Runtime name -> driver."""

from __future__ import annotations

from drivers.base import Driver

RUNTIMES = ("claude", "codex", "pi", "opencode", "kilo")


def get_driver(runtime: str) -> Driver:
    if runtime == "claude":
        from drivers.claude import ClaudeDriver

        return ClaudeDriver()
    if runtime == "codex":
        from drivers.codex import CodexDriver

        return CodexDriver()
    if runtime == "pi":
        from drivers.pi import PiDriver

        return PiDriver()
    if runtime in ("opencode", "kilo"):
        from drivers.bridge import BridgeDriver

        return BridgeDriver(runtime)
    raise KeyError(f"unknown runtime {runtime!r}; expected one of {', '.join(RUNTIMES)}")
