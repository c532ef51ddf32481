"""Claude Code (``claude -p`` stream-json): launch.py (argv, env, files), wire.py (parsing,
tracker), session.py (driver, handshake, turns, fork), fork_at.py (in-sandbox fork-point resolver)."""

from drivers.claude.launch import ClaudeSettings
from drivers.claude.session import ClaudeDriver, ClaudeSession

__all__ = ["ClaudeDriver", "ClaudeSession", "ClaudeSettings"]
