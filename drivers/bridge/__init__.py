"""OpenCode and Kilo through the in-sandbox live bridge: launch.py (argv, env, files), wire.py
(parsing), session.py (driver, handshake, turns, fork)."""

from drivers.bridge.session import BridgeDriver, BridgeSession

__all__ = ["BridgeDriver", "BridgeSession"]
