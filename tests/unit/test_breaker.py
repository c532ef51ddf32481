"""The keyed circuit breaker's state machine (fake clock) and the control-plane publisher
behind it (httpx MockTransport)."""

from __future__ import annotations

import anyio
import httpx
import pytest

from runner.breaker import BreakerOpen, CircuitBreaker, State
from runner.control_plane import HeartbeatPublisher, redact_url


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def fail_n(b: CircuitBreaker, key: str, n: int) -> None:
    for _ in range(n):
        b.failure(b.admit(key), "boom")


def test_closed_opens_after_exactly_n_consecutive_failures() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=3, reset_timeout_s=10, clock=clock)
    fail_n(b, "k", 2)
    assert b.state("k") == State.CLOSED
    b.success(b.admit("k"))  # a success resets the consecutive count
    fail_n(b, "k", 2)
    assert b.state("k") == State.CLOSED
    fail_n(b, "k", 1)
    assert b.state("k") == State.OPEN
    with pytest.raises(BreakerOpen) as err:
        b.admit("k")
    assert (err.value.state, err.value.retry_in_s) == (State.OPEN, 10.0)
    clock.t += 9.5
    with pytest.raises(BreakerOpen) as err:
        b.admit("k")
    assert err.value.retry_in_s == pytest.approx(0.5)
    snap = b.snapshot()["k"]
    assert (snap["state"], snap["admitted"], snap["rejected"], snap["failed"], snap["succeeded"]) == \
        ("open", 6, 2, 5, 1)
    assert snap["last_error"] == "boom"


def test_half_open_admits_exactly_one_trial_then_closes_on_success() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, reset_timeout_s=5, clock=clock)
    fail_n(b, "k", 2)
    clock.t += 5
    trial = b.admit("k")
    assert trial.trial and b.state("k") == State.HALF_OPEN
    for _ in range(3):  # every other call fails fast while the trial is in flight
        with pytest.raises(BreakerOpen) as err:
            b.admit("k")
        assert err.value.state == State.HALF_OPEN
    b.success(trial)
    assert b.state("k") == State.CLOSED
    t = b.admit("k")
    assert not t.trial
    fail_n(b, "k", 1)
    assert b.state("k") == State.CLOSED  # the count restarted at the close
    b.success(t)


def test_half_open_trial_failure_reopens_for_a_fresh_period() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=clock)
    fail_n(b, "k", 1)
    clock.t += 7
    b.failure(b.admit("k"))
    assert b.state("k") == State.OPEN
    clock.t += 4.9  # the period restarted at the failed trial, not at the first opening
    with pytest.raises(BreakerOpen):
        b.admit("k")
    clock.t += 0.1
    assert b.admit("k").trial


def test_late_results_of_older_calls_do_not_move_the_circuit() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, reset_timeout_s=5, clock=clock)
    slow_ok, slow_bad = b.admit("k"), b.admit("k")
    fail_n(b, "k", 2)
    assert b.state("k") == State.OPEN
    b.success(slow_ok)  # admitted while closed; finishes while open: ignored
    assert b.state("k") == State.OPEN
    clock.t += 5
    trial = b.admit("k")
    b.failure(slow_bad)  # a stale failure cannot end the half-open trial
    assert b.state("k") == State.HALF_OPEN
    b.success(trial)
    assert b.state("k") == State.CLOSED


def test_keys_are_independent() -> None:
    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=Clock())
    fail_n(b, "dead", 1)
    assert b.state("dead") == State.OPEN
    assert not b.admit("alive").trial and b.state("alive") == State.CLOSED


@pytest.mark.anyio
async def test_guard_counts_exceptions_and_cancellation_as_failures() -> None:
    clock = Clock()
    b = CircuitBreaker(failure_threshold=2, reset_timeout_s=5, clock=clock)
    with pytest.raises(RuntimeError):
        async with b.guard("k"):
            raise RuntimeError("down")
    with anyio.move_on_after(0.01):
        async with b.guard("k"):
            await anyio.sleep(10)
    assert b.state("k") == State.OPEN
    clock.t += 5
    async with b.guard("k") as ticket:
        assert ticket.trial
    assert b.state("k") == State.CLOSED


def test_invalid_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failure_threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker(reset_timeout_s=0)


def test_redact_url_drops_credentials() -> None:
    assert redact_url("https://user:pw@cp.example:8443/beat?token=x#f") == "https://cp.example:8443/beat"


@pytest.mark.anyio
async def test_publisher_opens_on_a_dead_control_plane_and_fails_fast() -> None:
    clock = Clock()
    calls: list[httpx.Request] = []

    def dead(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        raise httpx.ConnectError("refused", request=request)

    b = CircuitBreaker(failure_threshold=2, reset_timeout_s=30, clock=clock)
    pub = HeartbeatPublisher("http://cp.invalid/beat", body=lambda: {"beats": 1}, breaker=b, interval_s=1,
                             timeout_s=1, transport=httpx.MockTransport(dead))
    results = [await pub.publish_once() for _ in range(5)]
    assert results == ["failed", "failed", "fast_failed", "fast_failed", "fast_failed"]
    assert len(calls) == 2
    status = pub.status()
    assert (status["sent"], status["failed"], status["fast_failed"], status["circuit"]["state"]) == (0, 2, 3, "open")


@pytest.mark.anyio
async def test_publisher_half_open_sends_one_trial_while_others_fail_fast() -> None:
    clock = Clock()
    gate = anyio.Event()
    bodies: list[bytes] = []

    async def slow_ok(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        await gate.wait()
        return httpx.Response(204)

    class Async(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await slow_ok(request)

    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=5, clock=clock)
    b.failure(b.admit("control-plane http://cp.invalid/beat"))
    clock.t += 5
    pub = HeartbeatPublisher("http://cp.invalid/beat", body=lambda: {"beats": 7}, breaker=b, interval_s=1,
                             timeout_s=5, transport=Async())
    results: list[str] = []

    async def one() -> None:
        results.append(await pub.publish_once())

    async with anyio.create_task_group() as tg:
        tg.start_soon(one)
        await anyio.sleep(0.05)
        for _ in range(4):
            tg.start_soon(one)
        await anyio.sleep(0.05)
        gate.set()
    assert sorted(results) == ["fast_failed"] * 4 + ["sent"]
    assert bodies == [b'{"beats":7}']
    assert b.state(pub.key) == State.CLOSED


@pytest.mark.anyio
async def test_publisher_times_out_a_control_plane_that_never_answers() -> None:
    async def hang(request: httpx.Request) -> httpx.Response:
        await anyio.sleep(60)
        raise AssertionError("unreachable")

    class Hang(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            return await hang(request)

    b = CircuitBreaker(failure_threshold=1, reset_timeout_s=30)
    pub = HeartbeatPublisher("http://cp.invalid/beat", body=dict, breaker=b, interval_s=1, timeout_s=0.2,
                             transport=Hang())
    with anyio.fail_after(2):
        assert await pub.publish_once() == "failed"
        assert await pub.publish_once() == "fast_failed"
    assert b.snapshot()[pub.key]["last_error"].startswith("TimeoutError")
