"""runner.launch_slots: at most N launches hold a slot; the rest wait in arrival order."""

from __future__ import annotations

import anyio
import pytest
from prometheus_client import CollectorRegistry

from runner.launch_slots import LaunchSlots, default_slots

pytestmark = pytest.mark.anyio


async def test_at_most_the_slots_hold_at_once_and_waiters_go_in_arrival_order() -> None:
    registry = CollectorRegistry()
    slots = LaunchSlots(2, registry)
    holding, most, order = 0, 0, []
    release = anyio.Event()

    async def launch(name: str) -> None:
        nonlocal holding, most
        async with slots.hold("kilo"):
            holding += 1
            most = max(most, holding)
            order.append(name)
            await release.wait()
            holding -= 1

    async with anyio.create_task_group() as tg:
        for name in ("a", "b", "c", "d", "e"):
            tg.start_soon(launch, name)
            await anyio.sleep(0.01)  # they arrive in this order
        assert order == ["a", "b"]
        assert registry.get_sample_value("cloud_agent_launches_starting") == 2
        assert registry.get_sample_value("cloud_agent_launches_waiting") == 3
        release.set()
    assert most == 2 and order == ["a", "b", "c", "d", "e"]
    assert registry.get_sample_value("cloud_agent_launch_slot_waits_total", {"runtime": "kilo"}) == 3
    assert registry.get_sample_value("cloud_agent_launches_starting") == 0
    assert registry.get_sample_value("cloud_agent_launch_slots") == 2


async def test_a_holder_that_fails_gives_its_slot_back() -> None:
    slots = LaunchSlots(1, CollectorRegistry())
    with pytest.raises(RuntimeError, match="handshake"):
        async with slots.hold("opencode"):
            raise RuntimeError("handshake failed")
    with anyio.fail_after(1):
        async with slots.hold("opencode"):
            pass


def test_slots_must_be_positive_and_default_to_the_usable_cpus() -> None:
    with pytest.raises(ValueError, match="at least 1, not 0"):
        LaunchSlots(0, CollectorRegistry())
    import os

    assert default_slots() == len(os.sched_getaffinity(0))
