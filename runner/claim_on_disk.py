"""The job's claim reaching the disk while its turn gets ready (SPEC 8, issue 16).

The fence's claim commits at once — a repeat of the job sees it — but its flush to disk
runs beside the work that comes before the CLI's input (the member read, the sandbox's
checks, the process) instead of in front of it: one commit's fsync is about a millisecond
here, most of what a LIVE turn spends in the store before the CLI. The turn waits for the
flush before the CLI gets the message, so a claim lost with the machine never belongs to
a message a CLI saw: a re-dispatch after a power loss runs the job once, as if it were new.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from state.contract import StoreUnavailable


class ClaimOnDisk:
    """Set once the store's flush of the claim has returned. A failed flush is the store's
    failure: :meth:`wait` raises :class:`StoreUnavailable`, which closes the job not_settled
    (the supervisor's handling) before the CLI saw anything."""

    def __init__(self) -> None:
        self._done = anyio.Event()
        self._error: Exception | None = None

    async def flush(self, sync: Callable[[], Awaitable[None]]) -> None:
        """Run as a task of the job's own task group: the job never outlives its flush."""
        try:
            await sync()
        except Exception as exc:  # noqa: BLE001 - kept for the turn: it fails before the CLI's input
            self._error = exc
        finally:
            self._done.set()

    async def wait(self) -> None:
        await self._done.wait()
        if self._error is not None:
            raise StoreUnavailable(f"the job's claim did not reach the disk: {self._error!r}") from self._error
