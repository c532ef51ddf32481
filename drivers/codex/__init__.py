"""Codex (``codex app-server`` JSON-RPC): launch.py (argv, env, config.toml), wire.py (parsing,
tracker), session.py (driver, handshake, turns, fork)."""

from drivers.codex.launch import CodexSettings
from drivers.codex.session import CodexDriver, CodexSession

__all__ = ["CodexDriver", "CodexSession", "CodexSettings"]
