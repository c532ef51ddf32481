"""Pi (``pi --mode rpc`` JSONL): launch.py (argv, env, models/settings files), wire.py (parsing,
tracker), session.py (driver, handshake, turns, fork)."""

from drivers.pi.launch import PiSettings
from drivers.pi.session import PiDriver, PiSession

__all__ = ["PiDriver", "PiSession", "PiSettings"]
