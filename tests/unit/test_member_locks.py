"""Member locks' sightings (runner/member_locks.py): a read of a member's state taken before its
lock stands for a read under it only while no holder of that member's lock released it."""

from __future__ import annotations

import anyio
import pytest

from runner.member_locks import MemberLocks

pytestmark = pytest.mark.anyio

A, B = ("u", "c", "a"), ("u", "c", "b")


async def test_a_sighting_stands_when_no_holder_released_the_lock_since() -> None:
    locks = MemberLocks()
    async with locks.hold(A):
        pass  # released before the sighting: its writes are in any read that starts after
    sighting = locks.sight(A)
    async with locks.hold(A):
        assert not sighting.spoiled
        locks.unsight(sighting)
    assert not sighting.spoiled  # our own release, after it was taken, does not count
    assert locks._sightings == {}


async def test_a_release_after_the_sighting_spoils_it_but_not_another_members() -> None:
    locks = MemberLocks()
    a, b = locks.sight(A), locks.sight(B)
    async with locks.hold(A):
        pass
    assert (a.spoiled, b.spoiled) == (True, False)
    held = locks.try_hold(B)
    assert held is not None
    async with held:
        pass
    assert b.spoiled  # the idle retire's lock counts too
    locks.unsight(a)
    locks.unsight(b)
    locks.unsight(b)  # idempotent
    assert locks._sightings == {} and len(locks) == 0


async def test_a_holder_from_before_the_sighting_spoils_it_when_it_lets_go() -> None:
    """A turn of the member that was running when the claim read the member: the read may
    predate that turn's commit, so its release spoils the sighting the waiting job holds."""
    locks = MemberLocks()
    order: list[str] = []
    entered, go = anyio.Event(), anyio.Event()

    async def earlier_turn() -> None:
        async with locks.hold(A):
            entered.set()
            await go.wait()
            order.append("earlier committed")

    async with anyio.create_task_group() as tg:
        tg.start_soon(earlier_turn)
        await entered.wait()
        sighting = locks.sight(A)
        go.set()
        async with locks.hold(A):
            order.append("next turn")
            assert sighting.spoiled
            locks.unsight(sighting)
    assert order == ["earlier committed", "next turn"]


async def test_several_sightings_of_one_member_are_spoiled_together() -> None:
    locks = MemberLocks()
    first, second = locks.sight(A), locks.sight(A)
    async with locks.hold_all([A, B]):
        pass
    assert first.spoiled and second.spoiled
