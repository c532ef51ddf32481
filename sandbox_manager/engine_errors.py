"""What the engine seam raises (every Engine implementation, the fakes included)."""

from __future__ import annotations


class EngineError(Exception):
    """The engine refused or failed a call."""


class NotFound(EngineError):
    pass


class Conflict(EngineError):
    """The engine answered 409: at a create, the name is another container's."""
