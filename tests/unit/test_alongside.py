"""runner.alongside: the side update and the main call wait at the same time; the main call's
error comes out as itself and cancels the side."""

from __future__ import annotations

import anyio
import pytest

from runner.alongside import alongside


class Fenced(Exception):
    pass


@pytest.mark.anyio
async def test_both_wait_at_the_same_time() -> None:
    # each waits for the other to have started: one after the other this never ends
    side_started, main_started = anyio.Event(), anyio.Event()
    order: list[str] = []

    async def side() -> None:
        side_started.set()
        await main_started.wait()
        order.append("side done")

    async def main() -> str:
        main_started.set()
        await side_started.wait()
        order.append("main done")
        return "member"

    with anyio.fail_after(5):
        assert await alongside(side, main) == "member"
    assert sorted(order) == ["main done", "side done"]


@pytest.mark.anyio
async def test_the_result_waits_for_the_side() -> None:
    done: list[str] = []

    async def side() -> None:
        await anyio.sleep(0.05)
        done.append("side")

    async def main() -> int:
        return 7

    assert await alongside(side, main) == 7
    assert done == ["side"]


@pytest.mark.anyio
async def test_a_failing_main_raises_itself_and_cancels_the_side() -> None:
    cancelled: list[bool] = []

    async def side() -> None:
        try:
            await anyio.sleep(30)
        except anyio.get_cancelled_exc_class():
            cancelled.append(True)
            raise

    async def main() -> None:
        await anyio.sleep(0.01)
        raise Fenced("lease expired")

    with anyio.fail_after(5), pytest.raises(Fenced, match="lease expired"):
        await alongside(side, main)
    assert cancelled == [True]


@pytest.mark.anyio
async def test_the_side_takes_its_first_step_before_the_main_call() -> None:
    # the turn's preparation runs long without a wait: the proxy's begin, the side, must be
    # sent before it, not at its first wait
    order: list[str] = []

    async def side() -> None:
        order.append("side sent its request")
        await anyio.sleep(0)
        order.append("side answered")

    async def main() -> int:
        order.append("main began")
        return 3

    assert await alongside(side, main) == 3
    assert order == ["side sent its request", "main began", "side answered"]
