"""The resident memory budget: the pure policy, and the launch gate over fake readings."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from structlog.testing import capture_logs

from runner.member_locks import MemberLocks
from runner.memory_budget import FLOOR_ESTIMATES, RECENT_S, BudgetPolicy, ResidentUse
from runner.resident_memory import ResidentMemory
from runner.residents import Resident, ResidentPool
from sandbox_manager.proc_memory import GroupMemory

MiB = 1024 * 1024


def sample(registry: CollectorRegistry, name: str) -> float:
    text = generate_latest(registry).decode()
    return next(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def use(name: str, mib: int | None, last: float, busy: bool = False, runtime: str = "codex",
        in_turn: bool = False) -> ResidentUse:
    return ResidentUse(key=("u", "c", name), runtime=runtime, measured=None if mib is None else mib * MiB,
                       last_used=last, busy=busy or in_turn, in_turn=in_turn)


def keys(plan) -> list[str]:
    return [k[2] for k in plan.retire]


def test_a_launch_that_fits_retires_nothing() -> None:
    policy = BudgetPolicy(1000 * MiB)
    plan = policy.plan([use("a", 300, 1), use("b", 300, 2)], "codex")
    assert (keys(plan), plan.fits, plan.used, plan.need) == ([], True, 600 * MiB, FLOOR_ESTIMATES["codex"])


def test_the_least_recently_used_idle_resident_makes_room() -> None:
    policy = BudgetPolicy(1000 * MiB)
    uses = [use("b", 300, 2), use("a", 300, 1), use("c", 300, 3)]
    assert keys(policy.plan(uses, "codex")) == ["a"]
    busy_a = [use("b", 300, 2), use("a", 300, 1, busy=True), use("c", 300, 3)]
    assert keys(policy.plan(busy_a, "codex")) == ["b"]  # never a resident in a turn
    assert keys(policy.plan(uses, "opencode")) == ["a", "b"]  # 620 MiB needs two of them


def test_a_launch_leaves_a_resident_whose_turn_just_ended_alone_but_growth_does_not() -> None:
    policy = BudgetPolicy(1000 * MiB)
    now = 1000.0
    uses = [use("old", 300, now - 60), use("just", 300, now - RECENT_S / 2), use("c", 300, now - 30)]
    assert keys(policy.plan(uses, "codex", now=now)) == ["old"]
    assert keys(policy.plan(uses, "opencode", now=now)) == ["old", "c"]  # 620 MiB: two, still not "just"
    crowded = [use("just", 300, now - 0.1), use("also", 300, now - 1.0), use("c", 300, now - 30, busy=True)]
    plan = policy.plan(crowded, "codex", now=now)
    assert (keys(plan), plan.fits) == ([], False)  # the launch waits for the grace to pass
    later = policy.plan(crowded, "codex", now=now + RECENT_S)
    assert (keys(later), later.fits) == (["also"], True)
    grown = [use("just", 600, now - 0.1), use("b", 500, now - 1, busy=True)]
    assert keys(policy.plan(grown, None, now=now)) == ["just"]  # over the budget: taken back at once


def test_nothing_is_retired_when_even_every_idle_one_would_not_make_room() -> None:
    policy = BudgetPolicy(1000 * MiB)
    plan = policy.plan([use("a", 450, 1, busy=True), use("b", 450, 2, busy=True), use("c", 50, 0)], "codex")
    assert (keys(plan), plan.fits) == ([], False)


def test_an_empty_host_always_fits_and_reservations_count() -> None:
    policy = BudgetPolicy(100 * MiB)
    assert policy.plan([], "kilo").fits  # one resident bigger than the budget must still run
    assert not policy.plan([], "kilo", reserved=1).fits
    policy = BudgetPolicy(1000 * MiB)
    assert keys(policy.plan([use("a", 300, 1), use("b", 300, 2)], "codex", reserved=300 * MiB)) == ["a"]


def test_growth_is_taken_back_from_idle_residents_only() -> None:
    policy = BudgetPolicy(1000 * MiB)
    uses = [use("a", 500, 3, busy=True), use("b", 400, 1), use("c", 300, 2)]
    plan = policy.plan(uses, None)
    assert (keys(plan), plan.fits, plan.used) == (["b"], True, 800 * MiB)
    all_busy = [use("a", 700, 1, busy=True), use("b", 400, 2, busy=True)]
    assert (keys(policy.plan(all_busy, None)), policy.plan(all_busy, None).fits) == ([], False)


def test_a_resident_never_costs_less_than_its_runtimes_estimate() -> None:
    policy = BudgetPolicy(1000 * MiB)
    starting = use("x", 20, 0)  # read while the CLI was still starting
    assert policy.cost(starting) == FLOOR_ESTIMATES["codex"]
    assert policy.cost(use("y", 400, 0)) == 400 * MiB


def test_estimates_never_go_below_the_floor_and_learn_the_largest_reading() -> None:
    policy = BudgetPolicy(1000 * MiB)
    policy.learn("codex", 10 * MiB)
    assert policy.estimate("codex") == FLOOR_ESTIMATES["codex"]
    policy.learn("codex", 200 * MiB)
    policy.learn("codex", 150 * MiB)
    assert policy.estimate("codex") == 200 * MiB
    assert policy.cost(use("x", None, 0)) == 200 * MiB  # unmeasured: the estimate
    assert policy.estimate("unknown-runtime") == max(FLOOR_ESTIMATES.values())


def test_a_resident_in_a_turn_costs_what_its_runtime_was_ever_measured_at() -> None:
    """A turn may grow its tree to the runtime's largest reading; the budget counts that before
    the turn runs, not one reading after (the stop-24 overshoot)."""
    policy = BudgetPolicy(1000 * MiB)
    policy.learn("codex", 260 * MiB)
    assert policy.cost(use("x", 150, 0, in_turn=True)) == 260 * MiB
    assert policy.cost(use("x", 150, 0)) == FLOOR_ESTIMATES["codex"]  # idle: its own reading, floored
    assert policy.cost(use("x", 300, 0, in_turn=True)) == 300 * MiB  # its own reading when larger
    assert policy.used([use("a", 150, 0, in_turn=True), use("b", 200, 1)]) == 460 * MiB


# -- the launch gate ----------------------------------------------------------------------------


class FakeReader:
    """Every resident's group reads as ``sizes[pgid]`` MiB; pidfiles name their pgid."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.pss_asked: list[bool] = []  # each measure's pss argument
        self.relays_asked: list[dict[int, str]] = []  # each measure's relays argument

    def read_pidfile(self, init_pid: int, path: str) -> int | None:
        return int(path.rsplit("/", 1)[1].split(".")[0])

    def measure(self, init_pid: int, pgids: set[int], *, pss: bool = True,
                relays: dict[int, str] | None = None) -> dict[int, GroupMemory]:
        self.pss_asked.append(pss)
        self.relays_asked.append(dict(relays or {}))
        return {p: GroupMemory(pgid=p, pids=1, rss_bytes=self.sizes[p] * MiB, pss_bytes=self.sizes[p] * MiB // 2 if pss else 0,
                            hwm_bytes=self.sizes[p] * MiB)
                for p in pgids if p in self.sizes}


def resident(pool: ResidentPool, reader: FakeReader, name: str, pgid: int, mib: int, last: float,
             runtime: str = "codex") -> Resident:
    async def nothing(*args: Any) -> None:
        return None

    async def eof() -> None:
        return None

    session = SimpleNamespace(transport=SimpleNamespace(alive=True, receive=eof), locator=None, close=nothing)
    r = Resident(key=("u", "c", name), runtime=runtime, session=session, container_id="ctr",  # type: ignore[arg-type]
                 pidfile=f"/run/{pgid}.pid", kill=nothing, aclose=nothing, last_used=last, host_init_pid=1)
    reader.sizes[pgid] = mib
    pool.add(r)
    return r


def budget_rig(budget: int, *, reader: FakeReader | None = None, report_every_s: float = 30.0,
               pss_every_s: float = 0.0) -> tuple[ResidentPool, MemberLocks, Any, CollectorRegistry, ResidentMemory]:
    """A memory budget over a pool whose residents the fake reader measures."""
    pool, locks, registry = ResidentPool(grace_s=0.1), MemberLocks(), CollectorRegistry()
    reader = reader if reader is not None else FakeReader()
    mem = ResidentMemory(budget, pool=pool, locks=locks, registry=registry, refresh_s=60,
                         report_every_s=report_every_s, reader=reader,  # type: ignore[arg-type]
                         pss_every_s=pss_every_s)
    return pool, locks, reader, registry, mem


pytestmark = pytest.mark.anyio


async def test_the_gate_retires_the_lru_idle_resident_and_waits_for_a_busy_one() -> None:
    pool, locks, reader, registry, mem = budget_rig(500 * MiB)
    resident(pool, reader, "a", 11, 150, last=1)
    resident(pool, reader, "b", 12, 150, last=2)
    resident(pool, reader, "c", 13, 150, last=3)
    async with mem.launching(("u", "c", "d"), "codex"):  # 450 + 160 > 500: the LRU idle one goes
        assert mem.reserved == {("u", "c", "d"): FLOOR_ESTIMATES["codex"]}
    assert sorted(k[2] for k in pool.keys()) == ["b", "c"] and mem.reserved == {}
    resident(pool, reader, "d", 14, 150, last=4)
    order: list[str] = []

    async def turn(name: str, release: anyio.Event) -> None:
        async with locks.hold(("u", "c", name)):
            await release.wait()
            order.append(f"{name} ended")
        mem.notify()

    b_done, c_done, d_done = anyio.Event(), anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        for name, ev in (("b", b_done), ("c", c_done), ("d", d_done)):
            tg.start_soon(turn, name, ev)
        await anyio.wait_all_tasks_blocked()

        async def launch_e() -> None:
            async with mem.launching(("u", "c", "e"), "codex"):
                order.append("e launched")

        tg.start_soon(launch_e)
        await anyio.wait_all_tasks_blocked()
        assert order == [] and sorted(k[2] for k in pool.keys()) == ["b", "c", "d"]  # all busy: it waits
        c_done.set()  # c's turn ends: c is idle, though b is the least recently used
        await anyio.wait_all_tasks_blocked()
        b_done.set()
        d_done.set()
    assert order[:2] == ["c ended", "e launched"]
    assert sorted(k[2] for k in pool.keys()) == ["b", "d"]
    text = generate_latest(registry).decode()
    assert 'cloud_agent_resident_memory_retirements_total{cause="launch"} 2.0' in text
    assert 'cloud_agent_resident_memory_waits_total{kind="launch"} 1.0' in text
    assert sample(registry, "cloud_agent_resident_memory_budget_bytes") == 500 * MiB


async def test_launches_make_room_in_arrival_order_so_a_large_one_is_not_starved() -> None:
    """A Claude launch (300 MiB) waits first, a Codex launch (160) after it. When one 150 MiB
    turn ends, only the Codex launch would fit; it must not take the room ahead of Claude,
    which would then wait behind every smaller launch (the load run's overcommits)."""
    pool, locks, reader, _, mem = budget_rig(500 * MiB)
    for name, pgid, last in (("b", 12, 2), ("c", 13, 3), ("d", 14, 4)):
        resident(pool, reader, name, pgid, 150, last=last)
    order: list[str] = []
    ends = {name: anyio.Event() for name in "bcd"}

    async def turn(name: str) -> None:
        async with locks.hold(("u", "c", name)):
            await ends[name].wait()
            order.append(f"{name} ended")
        mem.notify()

    finished = anyio.Event()

    async def launch(name: str, runtime: str) -> None:  # its turn holds its member's lock throughout
        async with locks.hold(("u", "c", name)):
            async with mem.launching(("u", "c", name), runtime):
                order.append(f"{name} launched")
                resident(pool, reader, name, 20 + len(order), FLOOR_ESTIMATES[runtime] // MiB, last=10 + len(order),
                         runtime=runtime)
            await finished.wait()

    async with anyio.create_task_group() as tg:
        for name in "bcd":
            tg.start_soon(turn, name)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(launch, "claude-e", "claude")
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(launch, "codex-f", "codex")
        await anyio.wait_all_tasks_blocked()
        ends["c"].set()  # 300 free with c retired: Codex would fit, Claude not yet
        await anyio.wait_all_tasks_blocked()
        assert order == ["c ended"], order
        ends["b"].set()  # b and c retired: Claude fits (150 + 300), first; Codex waits for d
        await anyio.wait_all_tasks_blocked()
        assert order == ["c ended", "b ended", "claude-e launched"], order
        ends["d"].set()
        await anyio.wait_all_tasks_blocked()
        finished.set()
    assert order == ["c ended", "b ended", "claude-e launched", "d ended", "codex-f launched"], order
    assert sorted(k[2] for k in pool.keys()) == ["claude-e", "codex-f"]


async def test_a_launch_that_waits_long_never_goes_over_the_budget() -> None:
    """Every resident is in a long turn: the launch waits (reported, counted) as long as that
    takes and never goes ahead over the budget; it launches when a turn ends. (Until stop 22 it
    went ahead over the budget after a turn timeout: 3 and 5 times in the 48-chat load run.)"""
    pool, locks, reader, registry, mem = budget_rig(500 * MiB, report_every_s=0.05)
    for name, pgid, last in (("a", 11, 1), ("b", 12, 2), ("c", 13, 3)):
        resident(pool, reader, name, pgid, 150, last=last)
    ends = {name: anyio.Event() for name in "abc"}
    order: list[str] = []

    async def turn(name: str) -> None:
        async with locks.hold(("u", "c", name)):
            await ends[name].wait()
            order.append(f"{name} ended")
        mem.notify()

    async def launch() -> None:
        async with locks.hold(("u", "c", "d")):
            async with mem.launching(("u", "c", "d"), "codex"):
                order.append("d launched")
                assert mem.committed() <= 500 * MiB

    with capture_logs() as logs:
        async with anyio.create_task_group() as tg:
            for name in "abc":
                tg.start_soon(turn, name)
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(launch)
            await anyio.sleep(1.5)  # over the gate's own 1 s re-plan, and many report periods
            assert order == [] and mem.reserved == {}
            assert sample(registry, "cloud_agent_resident_memory_waiting") == 1
            ends["b"].set()
            with anyio.fail_after(5):
                while "d launched" not in order:
                    await anyio.sleep(0.01)
            assert order == ["b ended", "d launched"], order
            assert sorted(k[2] for k in pool.keys()) == ["a", "c"]  # b, idle after its turn, made the room
            ends["a"].set()
            ends["c"].set()
    assert sample(registry, "cloud_agent_resident_memory_waiting") == 0
    assert 'cloud_agent_resident_memory_waits_total{kind="launch"} 1.0' in generate_latest(registry).decode()
    still = [e for e in logs if e["event"] == "memory_budget.launch_still_waits"]
    assert len(still) >= 1 and all(e["runtime"] == "codex" and e["budget"] == 500 * MiB for e in still)
    assert all(e["committed"] == 3 * FLOOR_ESTIMATES["codex"] for e in still)  # each counts its floor


async def test_growth_in_a_turn_retires_idle_residents_at_the_check() -> None:
    pool, locks, reader, registry, mem = budget_rig(600 * MiB)
    resident(pool, reader, "a", 11, 100, last=1)
    resident(pool, reader, "b", 12, 100, last=2)
    resident(pool, reader, "c", 13, 200, last=3)
    assert await mem.check() == 0
    async with locks.hold(("u", "c", "c")):
        reader.sizes[13] = 390  # c grows in its turn: a and b count their 160 MiB estimate
        assert await mem.check() == 1  # a goes; c, in a turn, is never retired
    assert sorted(k[2] for k in pool.keys()) == ["b", "c"]
    assert 'cloud_agent_resident_memory_retirements_total{cause="over_budget"} 1.0' in generate_latest(
        registry).decode()
    assert sample(registry, "cloud_agent_resident_memory_used_bytes") == 490 * MiB


async def test_only_the_periodic_check_reads_pss_and_its_gauge_keeps_the_last_reading() -> None:
    """PSS (``smaps_rollup``) is most of a reading's CPU and only its gauge uses it: a launch's
    reading, which the launch waits for, leaves it unread and the gauge as it was."""
    pool, locks, reader, registry, mem = budget_rig(2000 * MiB)
    resident(pool, reader, "a", 11, 100, last=1)
    resident(pool, reader, "b", 12, 300, last=2)
    assert await mem.check() == 0
    assert reader.pss_asked == [True]
    assert sample(registry, "cloud_agent_resident_memory_pss_bytes") == 200 * MiB  # the fake's PSS: half of RSS
    reader.sizes[12] = 500
    async with mem.launching(("u", "c", "c"), "codex"):
        pass
    assert reader.pss_asked == [True, False]
    assert sample(registry, "cloud_agent_resident_memory_used_bytes") == 600 * MiB  # RSS read again
    assert sample(registry, "cloud_agent_resident_memory_pss_bytes") == 200 * MiB  # PSS as last read
    await mem.check()
    assert reader.pss_asked == [True, False, True]
    assert sample(registry, "cloud_agent_resident_memory_pss_bytes") == 300 * MiB


async def test_the_periodic_check_reads_pss_once_a_pss_period() -> None:
    """``smaps_rollup`` of a Node or Bun CLI's tens of GB of mappings, at every check, was most
    of the daemon's CPU a turn under 16 chats of OpenCode and Kilo: the gauge's PSS is read once
    a ``pss_every_s``, the budget's RSS at every check."""
    pool, locks, reader, registry, mem = budget_rig(2000 * MiB, pss_every_s=60.0)
    resident(pool, reader, "a", 11, 100, last=1)
    for _ in range(3):
        await mem.check()
    assert reader.pss_asked == [True, False, False]
    assert sample(registry, "cloud_agent_resident_memory_pss_bytes") == 50 * MiB
    reader.sizes[11] = 300
    await mem.check()
    assert sample(registry, "cloud_agent_resident_memory_used_bytes") == 300 * MiB  # RSS at every check
    assert sample(registry, "cloud_agent_resident_memory_pss_bytes") == 50 * MiB  # PSS as last read
    mem._pss_read_at = time.monotonic() - 60.0  # a PSS period later
    await mem.check()
    assert reader.pss_asked == [True, False, False, False, True]
    assert sample(registry, "cloud_agent_resident_memory_pss_bytes") == 150 * MiB


# -- the turn gate ------------------------------------------------------------------------------


class CountingReader(FakeReader):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def measure(self, init_pid: int, pgids: set[int], *, pss: bool = True,
                relays: dict[int, str] | None = None) -> dict[int, GroupMemory]:
        self.reads += 1
        return super().measure(init_pid, pgids, pss=pss, relays=relays)


async def test_a_turn_that_fits_reads_nothing_and_one_that_does_not_retires_the_lru_idle_resident() -> None:
    pool, locks, reader, registry, mem = budget_rig(500 * MiB, reader=CountingReader())
    mem.policy.learn("codex", 300 * MiB)  # a codex turn was once seen at 300 MiB
    resident(pool, reader, "a", 11, 150, last=1)
    resident(pool, reader, "b", 12, 150, last=2)
    await mem.refresh()  # both read at 150 (until read, a resident costs the estimate)
    reader.reads = 0
    async with locks.hold(("u", "c", "b")):
        await mem.turn_room(("u", "c", "b"), "codex")  # a 160 (floor) + b 300 (in its turn) = 460
        assert reader.reads == 0 and sorted(k[2] for k in pool.keys()) == ["a", "b"]
    resident(pool, reader, "c", 13, 150, last=3)
    async with locks.hold(("u", "c", "c")):
        await mem.turn_room(("u", "c", "c"), "codex")  # 160 + 160 + 300 = 620: the LRU idle one goes
        assert sorted(k[2] for k in pool.keys()) == ["b", "c"]
        assert mem.committed() == 460 * MiB
    assert 'cloud_agent_resident_memory_retirements_total{cause="turn"} 1.0' in generate_latest(registry).decode()


async def test_a_turn_far_under_the_budget_asks_no_residents_lock_and_one_near_it_counts_exactly() -> None:
    """The turn's room asks each resident's locks only near the budget: an upper bound of the
    count (every resident as if in its turn) answers first. Near the budget, the exact count
    (idle residents at their floor) still lets a turn run that the bound alone would not."""
    pool, locks, reader, registry, mem = budget_rig(2000 * MiB)
    mem.policy.learn("codex", 300 * MiB)
    for i in range(5):
        resident(pool, reader, f"m{i}", 20 + i, 150, last=i)
    await mem.refresh()
    asked: list[bool] = []
    exact = mem.uses

    def counting_uses(**kw: Any) -> Any:
        asked.append(True)
        return exact(**kw)

    mem.uses = counting_uses  # type: ignore[method-assign]
    async with locks.hold(("u", "c", "m0")):
        await mem.turn_room(("u", "c", "m0"), "codex")  # bound 5 x 300 = 1500 <= 2000
    assert asked == []
    mem.policy.budget = 1000 * MiB  # bound 1500 over it; exact: 4 idle at the 160 floor + 300 = 940
    async with locks.hold(("u", "c", "m0")):
        await mem.turn_room(("u", "c", "m0"), "codex")
        assert (len(asked), len(pool.keys())) == (1, 5)  # counted exactly once, nobody retired
        assert mem.committed() == 940 * MiB


def two_codex_residents() -> tuple[ResidentPool, MemberLocks, CollectorRegistry, ResidentMemory]:
    """A 500 MiB budget, codex learnt at 300 MiB, idle residents a (read at 150) then b (150)."""
    pool, locks, reader, registry, mem = budget_rig(500 * MiB)
    mem.policy.learn("codex", 300 * MiB)
    resident(pool, reader, "a", 11, 150, last=1)
    resident(pool, reader, "b", 12, 150, last=2)
    return pool, locks, registry, mem


async def test_turns_waiting_for_room_go_one_after_the_other_and_never_deadlock() -> None:
    """a and b both start turns when only one of them may grow: each counts at its reading while
    it waits, so the first in line goes, and the second goes when the first's turn ends."""
    pool, locks, registry, mem = two_codex_residents()
    order: list[str] = []
    a_done = anyio.Event()

    async def turn(name: str, done: anyio.Event | None) -> None:
        async with locks.hold(("u", "c", name)):
            await anyio.sleep(0)  # both hold their locks before either asks for room
            await mem.turn_room(("u", "c", name), "codex")
            order.append(f"{name} runs")
            if done is not None:
                await done.wait()
            order.append(f"{name} ended")
        mem.notify()

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(turn, "a", a_done)
            tg.start_soon(turn, "b", None)
            await anyio.wait_all_tasks_blocked()
            assert order == ["a runs"]  # b waits: a in its turn (300) + b's turn (300) > 500
            assert sample(registry, "cloud_agent_resident_memory_waiting") == 1
            a_done.set()
    assert order == ["a runs", "a ended", "b runs", "b ended"]
    assert sorted(k[2] for k in pool.keys()) == ["a", "b"]  # nobody retired: a was busy, then it fitted
    assert 'cloud_agent_resident_memory_waits_total{kind="turn"} 1.0' in generate_latest(registry).decode()


async def test_a_turn_with_nothing_to_wait_for_goes_even_over_the_budget() -> None:
    pool, locks, reader, _, mem = budget_rig(200 * MiB)
    mem.policy.learn("codex", 300 * MiB)
    resident(pool, reader, "a", 11, 150, last=1)
    with anyio.fail_after(5):
        async with locks.hold(("u", "c", "a")):
            await mem.turn_room(("u", "c", "a"), "codex")  # one resident larger than the budget still runs
    assert pool.keys() == [("u", "c", "a")]


async def test_turns_are_not_held_behind_a_launch_that_waits_for_their_residents() -> None:
    """a and b are in turns (their locks held) when a launch needs room that only they can give.
    Their turns' own room must not wait behind that launch: the launch waits for them to go
    idle, and they would wait for it (the host stalled this way in a 16-chat Kilo run)."""
    pool, locks, registry, mem = two_codex_residents()
    order: list[str] = []
    holding = anyio.Event()
    asked = anyio.Event()

    async def turn(name: str) -> None:
        async with locks.hold(("u", "c", name)):
            if name == "b":
                holding.set()
            await asked.wait()  # the launch is in line first
            await mem.turn_room(("u", "c", name), "codex")
            order.append(f"{name} runs")
            await anyio.sleep(0.01)
            order.append(f"{name} ended")
        mem.notify()

    async def launch() -> None:
        await holding.wait()
        async with mem.launching(("u", "c", "new"), "codex"):
            order.append("launch goes")

    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            tg.start_soon(turn, "a")
            tg.start_soon(turn, "b")
            tg.start_soon(launch)
            await anyio.wait_all_tasks_blocked()
            assert order == [] and len(mem._queue) == 1  # the launch waits: a and b are busy
            asked.set()
    # one turn's growth fits beside the other's reading, b's waits for a's turn to end; once a is
    # idle the launch may retire it (least recently used) — before or after b's turn runs
    assert order[:2] == ["a runs", "a ended"]
    assert sorted(order[2:]) == ["b ended", "b runs", "launch goes"] and order.index("b runs") < order.index("b ended")
    assert sorted(k[2] for k in pool.keys()) == ["b"]
    assert 'cloud_agent_resident_memory_retirements_total{cause="launch"} 1.0' in generate_latest(registry).decode()


async def test_a_reading_names_each_keepers_socket_so_its_relay_is_read_with_the_resident() -> None:
    """A keeper's relay (the daemon's attached exec: ~12 MiB of Python per resident) is in a
    session of its own; the reading finds it by the socket it names. The CI load test's
    sampler counts it and the budget did not: a peak read 1200.3 MiB of 1200."""
    pool, locks, reader, registry, mem = budget_rig(2000 * MiB)
    resident(pool, reader, "a", 11, 100, last=1).relay_socket = "/home/agent/members/a/run/keeper.sock"
    resident(pool, reader, "b", 12, 300, last=2)  # no keeper: a plain exec has no relay
    await mem.refresh()
    assert reader.relays_asked == [{11: "/home/agent/members/a/run/keeper.sock"}]
