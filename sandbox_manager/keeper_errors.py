"""What can go wrong on a keeper link (sandbox_manager.keeper).

Errors are one family under :class:`KeeperError`, itself an ``ExecStreamClosed``: whatever
treats a dead exec stream as a dead transport treats a lost keeper link the same way.
"""

from __future__ import annotations

from sandbox_manager.exec_stream import ExecLineTooLong, ExecStreamClosed


class KeeperError(ExecStreamClosed):
    """The keeper link failed; ``reason`` is a stable word, the message says what happened."""

    reason = "keeper_error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason:
            self.reason = reason


class KeeperUnavailable(KeeperError):
    """No keeper answers (never started, killed, or it could not start)."""

    reason = "no_keeper"


class KeeperRefused(KeeperError):
    """The keeper answered and refused the attach (e.g. ``offset_released``, ``offset_ahead``)."""

    reason = "refused"


class KeeperBroken(KeeperError):
    """More output than the bound went unacknowledged: nothing is replayable; retire the member."""

    reason = "broken"


class KeeperIdentityMismatch(KeeperError):
    """The keeper is not the one the store recorded: never trust it (retire, next turn RESTORED)."""

    reason = "identity_mismatch"

    def __init__(self, field: str, expected: object, observed: object) -> None:
        super().__init__(f"keeper identity mismatch on {field}: expected {expected!r}, observed {observed!r}")
        self.field, self.expected, self.observed = field, expected, observed


class KeeperDetached(KeeperError):
    """The attach stream ended (or a newer attach took over) before the CLI's output did.

    The keeper and the CLI may well live on: re-attach from the acknowledged offset.
    """

    reason = "detached"


class KeeperProtocolError(KeeperError):
    reason = "protocol"


class KeeperLineTooLong(KeeperError, ExecLineTooLong):
    """A CLI output line exceeded :attr:`KeeperChannel.max_line` (as the exec stream's)."""

    reason = "line_too_long"
