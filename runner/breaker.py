"""A keyed circuit breaker for optional outbound dependencies (e.g. the control plane).

A dead optional dependency must never starve turns: once a key has failed
``failure_threshold`` times in a row its circuit opens and every call fails fast with
:class:`BreakerOpen` (no connection, no timeout to wait out). After ``reset_timeout_s``
the circuit is half-open: exactly one trial call is admitted while every other call keeps
failing fast; the trial's success closes the circuit, its failure opens it again for
another ``reset_timeout_s``.

Single event loop, no awaits inside the state changes: every transition is atomic.
Results of calls admitted under an earlier state (a slow call that started while the
circuit was still closed) are ignored once the circuit has moved on (``generation``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import structlog

log = structlog.get_logger("breaker")


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerOpen(Exception):
    """The call was not attempted: the dependency's circuit is open (or its trial is running)."""

    def __init__(self, key: str, state: State, retry_in_s: float) -> None:
        super().__init__(f"circuit {key} is {state.value}; retry in {retry_in_s:.1f}s")
        self.key = key
        self.state = state
        self.retry_in_s = retry_in_s


@dataclass(frozen=True)
class Ticket:
    """An admitted call; hand it back to :meth:`CircuitBreaker.success` or ``failure``."""

    key: str
    generation: int
    trial: bool


@dataclass
class _Circuit:
    state: State = State.CLOSED
    failures: int = 0  # consecutive failures while closed
    opened_at: float = 0.0
    generation: int = 0
    admitted: int = 0
    rejected: int = 0
    succeeded: int = 0
    failed: int = 0
    last_error: str | None = None


class CircuitBreaker:
    def __init__(self, *, failure_threshold: int = 3, reset_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1 or reset_timeout_s <= 0:
            raise ValueError("failure_threshold must be >= 1 and reset_timeout_s > 0")
        self.failure_threshold = failure_threshold
        self.reset_timeout_s = reset_timeout_s
        self.clock = clock
        self._circuits: dict[str, _Circuit] = {}

    def _get(self, key: str) -> _Circuit:
        return self._circuits.setdefault(key, _Circuit())

    def _move(self, key: str, c: _Circuit, state: State) -> None:
        log.info("breaker.transition", key=key, old=c.state.value, new=state.value, failures=c.failures,
                 error=c.last_error if state == State.OPEN else None)
        c.state = state
        c.generation += 1
        if state == State.OPEN:
            c.opened_at = self.clock()
        if state == State.CLOSED:
            c.failures = 0

    def state(self, key: str) -> State:
        return self._get(key).state

    def admit(self, key: str) -> Ticket:
        """Admit a call or raise :class:`BreakerOpen` at once."""
        c = self._get(key)
        if c.state == State.OPEN:
            waited = self.clock() - c.opened_at
            if waited < self.reset_timeout_s:
                c.rejected += 1
                raise BreakerOpen(key, c.state, self.reset_timeout_s - waited)
            self._move(key, c, State.HALF_OPEN)
            c.admitted += 1
            return Ticket(key, c.generation, trial=True)
        if c.state == State.HALF_OPEN:  # the one trial is in flight
            c.rejected += 1
            raise BreakerOpen(key, c.state, 0.0)
        c.admitted += 1
        return Ticket(key, c.generation, trial=False)

    def success(self, ticket: Ticket) -> None:
        c = self._get(ticket.key)
        c.succeeded += 1
        if ticket.generation != c.generation:
            return
        if c.state == State.HALF_OPEN and ticket.trial:
            self._move(ticket.key, c, State.CLOSED)
        elif c.state == State.CLOSED:
            c.failures = 0

    def failure(self, ticket: Ticket, error: str | None = None) -> None:
        c = self._get(ticket.key)
        c.failed += 1
        if error is not None:
            c.last_error = error[:300]
        if ticket.generation != c.generation:
            return
        if c.state == State.HALF_OPEN and ticket.trial:
            self._move(ticket.key, c, State.OPEN)
        elif c.state == State.CLOSED:
            c.failures += 1
            if c.failures >= self.failure_threshold:
                self._move(ticket.key, c, State.OPEN)

    @asynccontextmanager
    async def guard(self, key: str) -> AsyncIterator[Ticket]:
        """``async with breaker.guard(key): await call()`` — any exception (cancellation
        included) counts as a failure of the call and is re-raised."""
        ticket = self.admit(key)
        try:
            yield ticket
        except BaseException as exc:
            self.failure(ticket, f"{type(exc).__name__}: {exc}")
            raise
        self.success(ticket)

    def snapshot(self) -> dict[str, dict[str, Any]]:
        now = self.clock()
        out: dict[str, dict[str, Any]] = {}
        for key, c in self._circuits.items():
            retry = max(0.0, self.reset_timeout_s - (now - c.opened_at)) if c.state == State.OPEN else 0.0
            out[key] = {"state": c.state.value, "consecutive_failures": c.failures, "retry_in_s": round(retry, 3),
                        "admitted": c.admitted, "rejected": c.rejected, "succeeded": c.succeeded,
                        "failed": c.failed, "last_error": c.last_error}
        return out
