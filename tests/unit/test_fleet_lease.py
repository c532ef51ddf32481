"""The lease heartbeat rides out a store that is briefly gone (SPEC 16): a renewal that hangs
or fails is retried within the lease's lifetime instead of a whole period later.

Found in CI: during the fleet suite's PostgreSQL restart, one renewal of a 20 s lease waited
10 s behind the connection pool and the next came after the lease had run out; the host
fenced itself although the server had long been back.
"""

from __future__ import annotations

import itertools

import anyio
import pytest

from runner.fleet import Fleet
from state.contract import HostLease, StoreUnavailable

pytestmark = pytest.mark.anyio

TTL_S = 3.0  # renew every 1 s; a failed attempt is retried 0.5 s later


class FlakyLeaseStore:
    """Only what ``Fleet.running`` calls. ``renew_lease`` plays the given script per call:
    ``"hang"`` never answers, ``"down"`` is a lost server, ``"ok"`` renews."""

    def __init__(self, script: list[str]) -> None:
        self.script = script
        self.calls: list[float] = []

    async def open(self) -> None:
        return None

    def bind_lease(self, lease: HostLease | None) -> None:
        return None

    async def register_host(self, host_id: str, api_url: str, capacity: int, ttl_s: float) -> HostLease:
        return HostLease(host_id, 1, 0)

    async def renew_lease(self, lease: HostLease, ttl_s: float) -> HostLease | None:
        self.calls.append(anyio.current_time())
        step = self.script[len(self.calls) - 1] if len(self.calls) <= len(self.script) else "ok"
        if step == "hang":
            await anyio.sleep_forever()
        if step == "down":
            raise StoreUnavailable("store lease heartbeat: OperationalError")
        return lease


def fleet(store: FlakyLeaseStore) -> Fleet:
    return Fleet(store, host_id="h1", api_url="http://127.0.0.1:1", capacity=1, ttl_s=TTL_S)  # type: ignore[arg-type]


async def test_a_renewal_that_never_answers_is_abandoned_and_retried_before_the_lease_runs_out() -> None:
    store = FlakyLeaseStore(["hang"])
    async with fleet(store).running() as f:
        start = anyio.current_time()
        await anyio.sleep(TTL_S + 1.0)  # past the lease the hung renewal would have let lapse
        assert f.lease_valid() and not f.fenced
    offsets = [round(t - start, 2) for t in store.calls]
    # 1 s: hangs, abandoned at 2 s; retried 0.5 s later (before the lease ends at 3 s) and renewed
    assert len(offsets) >= 2 and 2.4 <= offsets[1] < 2.9, offsets


async def test_a_lost_store_is_retried_every_half_second_not_every_period() -> None:
    store = FlakyLeaseStore(["down", "down", "down"])
    async with fleet(store).running() as f:
        start = anyio.current_time()
        await anyio.sleep(TTL_S + 0.8)
        assert f.lease_valid() and not f.fenced
    offsets = [round(t - start, 2) for t in store.calls]
    gaps = [round(b - a, 2) for a, b in itertools.pairwise(offsets)]
    # down at 1, 1.5 and 2 s, renewed at 2.5 s (the lease ended at 3 s), then every period again
    assert len(gaps) >= 4 and all(0.45 <= g < 0.75 for g in gaps[:3]) and 0.95 <= gaps[3] < 1.25, offsets
