"""The turn state machine (runner/turn.py) with a fake driver, a fake engine and the real SQLite
store, sandbox manager and model path (its proxy listening on each sandbox's unix socket): the NEW / LIVE / RESTORED / LOST decision, identity at settlement,
the retire rules, refusal stickiness and handshake failures (SPEC 3-5, 8)."""

from __future__ import annotations

import itertools
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import anyio
import pytest

from drivers.base import Driver, Launch, discard
from drivers.launch import LaunchSpec
from drivers.models import (
    FailureReason,
    GatewayConfig,
    HandshakeFailed,
    HandshakeReason,
    Locator,
    MemberPaths,
    NotSettled,
    NotSettledReason,
    Settlement,
    TurnOutcome,
)
from drivers.session import NativeSession, Tracker, TurnStart
from drivers.transport import Transport
from proxy import ProxyConfig
from runner.config import load_settings
from runner.launch_slots import LaunchSlots
from runner.model_path import ModelPath
from runner.residents import ResidentPool
from runner.turn import TestHooks as Hooks  # not collected as a test class
from runner.turn import TurnRunner
from runner.turn_context import InputNotReady
from sandbox_manager.sandbox_config import SandboxConfig
from sandbox_manager.sandboxes import SandboxManager
from state.jobs import Job
from state.receipts import Receipt
from state.records import MemberRecord
from state.store import Store
from tests.support.fake_engine import IMAGE, FakeEngine
from tests.support.store import erase_locator

pytestmark = pytest.mark.anyio

KEY = ("u1", "c1", "m1")
Turn = Callable[["FakeSession"], TurnOutcome]


@dataclass
class Script:
    """What the fake CLI does: one handshake result per launch, one outcome per turn."""

    # "hang": never answers; a float: answers after that many seconds
    handshakes: list[HandshakeFailed | str | float | None] = field(default_factory=list)
    handshaking: int = 0  # handshakes in flight now, and the most at once
    most_handshaking: int = 0
    turns: list[Turn] = field(default_factory=list)
    launches: list[Launch] = field(default_factory=list)
    messages: list[str] = field(default_factory=list)  # every message that reached a CLI
    minted: itertools.count = field(default_factory=lambda: itertools.count(1))


class FakeSession(NativeSession):
    """A session the runner drives through its own contract (handshake, run_turn, close, the
    locators): the turn template's CLI parts are not used (drivers have their own tiers)."""

    runtime = "codex"

    def __init__(self, transport: Transport, launch: Launch, script: Script) -> None:
        super().__init__(transport, launch)
        self.script = script

    async def open(self) -> None:
        raise NotImplementedError("FakeSession.handshake replaces the template")

    def turn_start(self) -> TurnStart:
        raise NotImplementedError("FakeSession.run_turn replaces the template")

    def tracker(self, start: TurnStart) -> Tracker:
        raise NotImplementedError("FakeSession.run_turn replaces the template")

    async def handshake(self) -> None:
        step = self.script.handshakes.pop(0) if self.script.handshakes else None
        self.script.handshaking += 1
        self.script.most_handshaking = max(self.script.most_handshaking, self.script.handshaking)
        try:
            if step == "hang":
                await anyio.sleep_forever()
            if isinstance(step, float):
                await anyio.sleep(step)
        finally:
            self.script.handshaking -= 1
        if isinstance(step, HandshakeFailed):
            raise step
        if not self.launch.resume:
            self.expected = Locator(id=f"minted-{next(self.script.minted)}")  # the CLI mints its id
        self.cli_version = "fake-cli 1.0"

    async def run_turn(self, message: str, *, emit=discard, timeout_s: float = 600.0) -> TurnOutcome:
        if self.before_turn is not None:  # as the template does, before the opening is sent
            await self.before_turn(TurnStart(turn=len(self.script.messages) + 1))
        self.script.messages.append(message)
        return self.script.turns.pop(0)(self)


class FakeDriver(Driver):
    runtime = "codex"

    def __init__(self, script: Script) -> None:
        self.script = script

    def plan(self, paths: MemberPaths, gateway: GatewayConfig, resume: Locator | None) -> Launch:
        launch = Launch(spec=LaunchSpec(runtime="codex", argv=["fake-cli"], cwd=paths.workspace), expected=resume,
                        resume=resume is not None)
        self.script.launches.append(launch)
        return launch

    def session(self, transport: Transport, launch: Launch) -> NativeSession:
        return FakeSession(transport, launch, self.script)


def settled(*, is_error: bool = False, locator: str | None = None, retire_after: bool = False) -> Turn:
    """A settled turn reporting the session's own id (or ``locator``)."""

    def turn(s: FakeSession) -> TurnOutcome:
        own = s.locator or s.expected
        observed = Locator(id=locator) if locator else own
        return Settlement(evidence="fake:done", is_error=is_error, observed_locator=observed,
                          reason=FailureReason.API_ERROR if is_error else None, assistant_text="a reply",
                          retire_after=retire_after)

    return turn


def not_settled(reason: NotSettledReason = NotSettledReason.TIMEOUT) -> Turn:
    return lambda s: NotSettled(reason=reason, detail="fake", assistant_text="partial")


@dataclass
class Rig:
    store: Store
    engine: FakeEngine
    pool: ResidentPool
    runner: TurnRunner
    script: Script
    events: list[dict[str, Any]] = field(default_factory=list)
    jobs: itertools.count = field(default_factory=itertools.count)

    async def run(self, message: str = "hello", *, runtime: str = "codex", member_id: str = KEY[2],
                  **extra: Any) -> Receipt:
        claim_on_disk = extra.pop("claim_on_disk", None)  # with it, the claim is made sync=False
        job = Job(job_id=f"job-{next(self.jobs)}", user_id=KEY[0], chat_id=KEY[1], member_id=member_id, runtime=runtime,
                  message=message, **extra)
        claim = await self.store.claim_job(job.job_id, job.user_id, job.chat_id, job.member_id, job.digest(), "me",
                                           sync=claim_on_disk is None)
        assert claim.kind == "claimed"
        receipt = await self.runner.execute(job, self.events.append, claim_on_disk=claim_on_disk)
        stored = await self.store.get_job(job.user_id, job.job_id)
        assert stored is not None and Receipt.model_validate_json(stored.receipt_json or "{}") == receipt
        return receipt

    async def member(self) -> MemberRecord:
        m = await self.store.get_member(*KEY)
        assert m is not None
        return m

    @property
    def resident(self) -> bool:
        return self.pool.is_resident(KEY)


def outcome(r: Receipt) -> tuple[str | None, str, str | None]:
    return (r.context_status.value if r.context_status else None, r.outcome.value, r.reason)


@asynccontextmanager
async def make_rig(tmp_path, launch_slots: LaunchSlots | None = None, **hooks: Any) -> AsyncIterator[Rig]:
    store = Store(tmp_path / "store.db")
    engine = FakeEngine()
    sockets = tempfile.mkdtemp(prefix="ca-turn-", dir="/tmp")  # a tmp_path is too long for a socket address
    manager = SandboxManager(engine, store, SandboxConfig(image=IMAGE, socket_root=sockets, host_id="host-t"))  # type: ignore[arg-type]
    key = tmp_path / "gateway-key"
    key.write_text("sk-unit-test-key\n")
    # the proxy in this process: the turn state machine, not the proxy service, is under test here
    settings = load_settings({"CLOUD_AGENT_HOME": str(tmp_path), "CLOUD_AGENT_PROXY_PROCESS": "daemon"})
    model_path = ModelPath(settings, "http://127.0.0.1:9", store, manager,
                           config=ProxyConfig(upstream_url="http://127.0.0.1:9", key_file=key))
    pool = ResidentPool(grace_s=0.1)
    script = Script()
    runner = TurnRunner(store=store, manager=manager, pool=pool, model_path=model_path,
                        models={"codex": "m", "pi": "m"}, turn_timeout_s=5,
                        handshake_timeout_s=0.5, hooks=Hooks(**hooks), launch_slots=launch_slots,
                        drivers=lambda runtime, options: FakeDriver(script))
    try:
        async with model_path.running():
            yield Rig(store=store, engine=engine, pool=pool, runner=runner, script=script)
            await pool.retire_all("test over")
    finally:
        store.close()
        shutil.rmtree(sockets, ignore_errors=True)


@pytest.fixture
async def rig(tmp_path):
    async with make_rig(tmp_path) as r:
        yield r


# -- the status decision ----------------------------------------------------------------------------


async def test_new_then_live_then_restored_after_retire(rig: Rig) -> None:
    rig.script.turns = [settled(), settled(), settled()]
    first = await rig.run("one")
    assert outcome(first) == ("NEW", "succeeded", None)
    assert (first.locator_before, first.locator_after, first.cli_version) == (None, "minted-1", "fake-cli 1.0")
    assert rig.events[0] == {"type": "status", "context_status": "NEW"}
    second = await rig.run("two")
    assert outcome(second) == ("LIVE", "succeeded", None)
    assert (second.locator_before, second.locator_after) == ("minted-1", "minted-1")
    assert len(rig.script.launches) == 1, "a LIVE turn reuses the resident process"
    await rig.pool.retire(KEY, "test")
    third = await rig.run("three")
    assert outcome(third) == ("RESTORED", "succeeded", None)
    assert [(x.resume, x.expected) for x in rig.script.launches] == [(False, None), (True, Locator(id="minted-1"))]
    m = await rig.member()
    assert (m.locator.id if m.locator else None, m.settled_turns, m.last_status) == ("minted-1", 3, "RESTORED")
    assert rig.script.messages == ["one", "two", "three"], "messages reach the CLI unchanged"


async def test_a_dead_resident_is_replaced_and_restored(rig: Rig) -> None:
    rig.script.turns = [settled(), settled()]
    await rig.run()
    rig.engine.streams[0].closed = True  # the process died between turns
    again = await rig.run()
    assert outcome(again) == ("RESTORED", "succeeded", None)
    assert len(rig.script.launches) == 2


async def test_a_removed_container_is_recreated_on_the_volume_and_restored(rig: Rig) -> None:
    rig.script.turns = [settled(), settled()]
    first = await rig.run("one")
    await rig.engine.remove(first.sandbox.container_id)  # the resident's process goes with it
    again = await rig.run("two")
    assert outcome(again) == ("RESTORED", "succeeded", None)
    assert (again.sandbox.volume, again.sandbox.recreated) == (first.sandbox.volume, True)
    assert again.sandbox.container_id != first.sandbox.container_id
    assert [(x.resume, x.expected) for x in rig.script.launches] == [(False, None), (True, Locator(id="minted-1"))]
    assert rig.script.messages == ["one", "two"]


async def test_a_lost_volume_is_refused_and_the_member_stays_lost(rig: Rig) -> None:
    rig.script.turns = [settled()]
    first = await rig.run()
    await rig.engine.remove(first.sandbox.container_id)
    await rig.engine.remove_volume(first.sandbox.volume)  # SPEC 15: the native state is gone with it
    lost = await rig.run("never sent")
    assert outcome(lost) == ("LOST", "refused", "volume_missing")
    assert lost.locator_after == first.locator_after
    assert (await rig.member()).lost_reason == "volume_missing"
    assert not rig.resident
    again = await rig.run("never sent either")
    assert outcome(again) == ("LOST", "refused", "previously_lost")
    assert rig.script.messages == ["hello"] and len(rig.script.launches) == 1


async def test_a_resident_turn_on_facts_the_events_had_not_yet_spoiled_is_refused_lost(rig: Rig) -> None:
    """The container and its volume are removed just before a resident's turn, and the engine's
    events have not reached the daemon: the turn is checked from the kept facts and its CLI link
    ends at once. The turn asks the engine and is the LOST refusal (SPEC 15), not a LIVE
    not_settled on facts that were stale (issue 16)."""
    from sandbox_manager.integrity import Facts

    rig.script.turns = [settled(), not_settled(NotSettledReason.TRANSPORT_CLOSED)]
    first = await rig.run()
    manager = rig.runner.manager
    cid, rec = first.sandbox.container_id, await rig.store.get_sandbox(KEY[0], KEY[1])
    integrity = manager.integrity
    integrity._connection = 1  # a live event stream (the fake engine has none) that kept the facts
    integrity.put(integrity.token(cid), Facts(await rig.engine.inspect(cid), await rig.engine.image(IMAGE),
                                              rec.data_root_id, rec.volume_name))
    await rig.engine.remove(cid)
    await rig.engine.remove_volume(first.sandbox.volume)
    lost = await rig.run("sent to a link that ended")
    assert outcome(lost) == ("LOST", "refused", "volume_missing")
    assert lost.locator_after == first.locator_after
    assert (await rig.member()).lost_reason == "volume_missing"
    assert not rig.resident
    assert outcome(await rig.run("never sent")) == ("LOST", "refused", "previously_lost")


async def keep_facts_of_the_first_sandbox(rig: Rig, first: Receipt) -> str:
    """A live event stream (the fake engine has none) that kept the first turn's facts."""
    from sandbox_manager.integrity import Facts

    cid, rec = first.sandbox.container_id, await rig.store.get_sandbox(KEY[0], KEY[1])
    integrity = rig.runner.manager.integrity
    integrity._connection = 1
    integrity.put(integrity.token(cid), Facts(await rig.engine.inspect(cid), await rig.engine.image(IMAGE),
                                              rec.data_root_id, rec.volume_name))
    return cid


def link_ended_while(event_arrives: Callable[[], None]) -> Turn:
    """The CLI's link ends before any output; the engine's late event reaches the daemon meanwhile."""

    def turn(s: FakeSession) -> TurnOutcome:
        event_arrives()
        return NotSettled(reason=NotSettledReason.TRANSPORT_CLOSED, detail="fake: the link ended")

    return turn


def die_event(cid: str, at_ns: int) -> dict[str, Any]:
    return {"Type": "container", "Action": "die", "Actor": {"ID": cid}, "timeNano": at_ns}


async def test_a_resident_turn_whose_container_was_removed_before_it_runs_again_restored(rig: Rig) -> None:
    """The container is removed (its volume kept) just before a resident's turn, and the engine's
    events reach the daemon only while the turn runs: the turn was checked from stale facts and
    its CLI link ended at once. The container's die came before the turn's message was written,
    so the CLI never read it: the same turn runs again on the recreated container, RESTORED
    through the resume handshake (SPEC 15), within that turn (issue 16)."""
    rig.script.turns = [settled()]
    first = await rig.run("one")
    cid = await keep_facts_of_the_first_sandbox(rig, first)
    removed_at = time.time_ns()
    await rig.engine.remove(cid)
    integrity = rig.runner.manager.integrity
    rig.script.turns = [link_ended_while(lambda: integrity.apply(die_event(cid, removed_at))), settled()]
    rig.events.clear()
    again = await rig.run("two")
    assert outcome(again) == ("RESTORED", "succeeded", None)
    assert (again.sandbox.volume, again.sandbox.recreated) == (first.sandbox.volume, True)
    assert again.sandbox.container_id != cid
    assert again.locator_before == again.locator_after == first.locator_after
    assert [(x.resume, x.expected) for x in rig.script.launches] == [(False, None), (True, Locator(id="minted-1"))]
    assert rig.script.messages == ["one", "two", "two"]  # the first "two" went to the link that had ended
    assert [e["context_status"] for e in rig.events if e["type"] == "status"] == ["LIVE", "RESTORED"]
    m = await rig.member()
    assert (m.settled_turns, m.last_status, m.lost_reason) == (2, "RESTORED", None)
    assert rig.resident


async def test_a_container_that_stopped_after_the_message_was_written_leaves_the_turn_not_settled(rig: Rig) -> None:
    """Its die came after the turn wrote the message: the CLI may have read it (and its history
    may hold it), so the turn is not run again; its not_settled stands and the next turn is
    RESTORED on the recreated container."""
    rig.script.turns = [settled()]
    first = await rig.run("one")
    cid = await keep_facts_of_the_first_sandbox(rig, first)
    await rig.engine.remove(cid)
    integrity = rig.runner.manager.integrity
    rig.script.turns = [link_ended_while(lambda: integrity.apply(die_event(cid, time.time_ns()))), settled()]
    stopped_later = await rig.run("two")
    assert outcome(stopped_later) == ("LIVE", "not_settled", "transport_closed")
    assert len(rig.script.launches) == 1 and rig.script.messages == ["one", "two"]
    after = await rig.run("three")
    assert outcome(after) == ("RESTORED", "succeeded", None)
    assert after.sandbox.recreated is True and after.locator_after == first.locator_after


async def test_a_stop_the_events_never_report_leaves_the_turn_not_settled(rig: Rig, monkeypatch) -> None:
    import runner.stale_facts

    monkeypatch.setattr(runner.stale_facts, "STOP_EVENT_WAIT_S", 0.05)
    rig.script.turns = [settled()]
    first = await rig.run("one")
    cid = await keep_facts_of_the_first_sandbox(rig, first)
    await rig.engine.remove(cid)
    rig.script.turns = [link_ended_while(lambda: None)]
    assert outcome(await rig.run("two")) == ("LIVE", "not_settled", "transport_closed")
    assert len(rig.script.launches) == 1


async def test_settled_turns_without_a_locator_are_lost(rig: Rig) -> None:
    rig.script.turns = [settled()]
    await rig.run()
    await rig.pool.retire(KEY, "test")
    erase_locator(rig.store, *KEY)
    refused = await rig.run("never sent")
    assert outcome(refused) == ("LOST", "refused", "member_locator_missing")
    assert (await rig.member()).lost_reason == "member_locator_missing"
    assert rig.script.messages == ["hello"]


async def test_another_runtime_for_the_member_is_refused_without_condemning_it(rig: Rig) -> None:
    rig.script.turns = [settled(), settled()]
    await rig.run()
    refused = await rig.run(runtime="pi")
    assert outcome(refused) == (None, "refused", "runtime_mismatch")
    assert (await rig.member()).lost_reason is None
    assert outcome(await rig.run()) == ("LIVE", "succeeded", None)


# -- a job naming a locator (SPEC 3: refused, with the member's real status) -------------------------


async def test_locator_mismatch_carries_the_real_status_and_is_not_sticky(rig: Rig) -> None:
    fresh = await rig.run("never sent", locator="someone-else")
    assert outcome(fresh) == ("NEW", "refused", "locator_mismatch")
    assert "create" not in rig.engine.calls, "a refused job creates no sandbox"
    rig.script.turns = [settled(), settled(), settled(), settled()]
    await rig.run("one")
    live = await rig.run("never sent", locator="someone-else")
    assert outcome(live) == ("LIVE", "refused", "locator_mismatch")
    assert (live.locator_before, live.locator_after) == ("minted-1", "minted-1")
    assert rig.resident, "the refusal leaves the resident process alone"
    assert outcome(await rig.run("two")) == ("LIVE", "succeeded", None)
    await rig.pool.retire(KEY, "test")
    restored = await rig.run("never sent", locator="someone-else")
    assert outcome(restored) == ("RESTORED", "refused", "locator_mismatch")
    m = await rig.member()
    assert (m.lost_reason, m.locator.id if m.locator else None, m.settled_turns) == (None, "minted-1", 2)
    assert outcome(await rig.run("three", locator="minted-1")) == ("RESTORED", "succeeded", None)
    assert outcome(await rig.run("four")) == ("LIVE", "succeeded", None)
    assert rig.script.messages == ["one", "two", "three", "four"]


async def test_locator_mismatch_on_a_lost_member_reports_lost(rig: Rig) -> None:
    rig.script.turns = [settled()]
    first = await rig.run()
    await rig.engine.remove(first.sandbox.container_id)
    await rig.engine.remove_volume(first.sandbox.volume)
    assert outcome(await rig.run()) == ("LOST", "refused", "volume_missing")
    named = await rig.run(locator="someone-else")
    assert outcome(named) == ("LOST", "refused", "locator_mismatch")


# -- identity at settlement -------------------------------------------------------------------------


@pytest.mark.parametrize("is_error", [False, True])
async def test_a_settled_turn_reporting_another_session_fails_and_keeps_the_locator(rig: Rig, is_error) -> None:
    rig.script.turns = [settled(), settled(is_error=is_error, locator="forged"), settled()]
    await rig.run()
    bad = await rig.run("two")
    assert outcome(bad) == ("LIVE", "failed", "identity_mismatch")
    assert (bad.locator_before, bad.locator_after, bad.settlement.is_error) == ("minted-1", "minted-1", is_error)
    assert bad.settlement.detail == f"expected {Locator(id='minted-1')}, CLI reported {Locator(id='forged')}"
    m = await rig.member()
    assert (m.locator.id if m.locator else None, m.settled_turns) == ("minted-1", 1)
    assert not rig.resident, "a process that reported another session is retired"
    again = await rig.run("three")
    assert outcome(again) == ("RESTORED", "succeeded", None)
    assert rig.script.launches[-1].expected == Locator(id="minted-1")


async def test_a_new_turn_reporting_another_id_than_its_handshake_saves_nothing(rig: Rig) -> None:
    rig.script.turns = [settled(locator="forged"), settled()]
    bad = await rig.run()
    assert outcome(bad) == ("NEW", "failed", "identity_mismatch")
    m = await rig.member()
    assert (m.locator, m.settled_turns) == (None, 0)
    assert outcome(await rig.run()) == ("NEW", "succeeded", None)
    assert (await rig.member()).locator.id == "minted-2"  # type: ignore[union-attr]


async def test_a_settled_failure_on_the_right_session_counts_and_stays_resident(rig: Rig) -> None:
    rig.script.turns = [settled(), settled(is_error=True), settled()]
    await rig.run()
    failed = await rig.run()
    assert outcome(failed) == ("LIVE", "failed", "api_error")
    assert rig.resident
    assert (await rig.member()).settled_turns == 2
    assert outcome(await rig.run()) == ("LIVE", "succeeded", None)


# -- retire rules -----------------------------------------------------------------------------------


async def test_a_turn_that_does_not_settle_retires_the_process_and_keeps_the_locator(rig: Rig) -> None:
    rig.script.turns = [settled(), not_settled(), settled()]
    await rig.run()
    ns = await rig.run("two")
    assert outcome(ns) == ("LIVE", "not_settled", "timeout")
    assert (ns.assistant_text, ns.locator_after) == ("partial", "minted-1")
    assert not rig.resident
    m = await rig.member()
    assert (m.locator.id if m.locator else None, m.settled_turns, m.last_outcome) == ("minted-1", 1, "not_settled")
    assert outcome(await rig.run("three")) == ("RESTORED", "succeeded", None)


async def test_retire_after_saves_the_locator_then_retires(rig: Rig) -> None:
    rig.script.turns = [settled(), settled(retire_after=True), settled()]
    await rig.run()
    flagged = await rig.run()
    assert outcome(flagged) == ("LIVE", "succeeded", None)
    assert not rig.resident
    assert (await rig.member()).settled_turns == 2
    assert outcome(await rig.run()) == ("RESTORED", "succeeded", None)


async def test_retire_after_can_be_disabled_by_the_test_hook(tmp_path) -> None:
    async with make_rig(tmp_path, disable_retire_after=True) as rig:
        rig.script.turns = [settled(retire_after=True), settled()]
        await rig.run()
        assert rig.resident
        assert outcome(await rig.run()) == ("LIVE", "succeeded", None)


# -- handshakes ------------------------------------------------------------------------------------


@pytest.mark.parametrize("reason", [HandshakeReason.LOCATOR_MISMATCH, HandshakeReason.NATIVE_STATE_MISSING])
async def test_a_resume_handshake_reporting_another_session_or_no_state_is_lost(rig: Rig, reason) -> None:
    rig.script.turns = [settled()]
    await rig.run("one")
    await rig.pool.retire(KEY, "test")
    rig.script.handshakes = [HandshakeFailed(reason, "the CLI resumed ses-other")]
    lost = await rig.run("never sent")
    assert outcome(lost) == ("LOST", "refused", reason.value)
    assert rig.script.messages == ["one"], "the message never reaches a CLI after a failed handshake"
    assert not rig.resident
    assert (await rig.member()).lost_reason == reason.value
    assert outcome(await rig.run("never sent either")) == ("LOST", "refused", "previously_lost")
    assert len(rig.script.launches) == 2


async def test_a_process_failing_its_handshake_is_not_settled_not_lost(rig: Rig) -> None:
    rig.script.handshakes = [HandshakeFailed(HandshakeReason.PROCESS_FAILED, "died")]
    rig.script.turns = [settled(), settled()]
    ns = await rig.run("never sent")
    assert outcome(ns) == ("NEW", "not_settled", "handshake_process_failed")
    assert outcome(await rig.run("one")) == ("NEW", "succeeded", None)
    await rig.pool.retire(KEY, "test")
    rig.script.handshakes = [HandshakeFailed(HandshakeReason.PROCESS_FAILED, "died")]
    ns = await rig.run("never sent")
    assert outcome(ns) == ("RESTORED", "not_settled", "handshake_process_failed")
    assert (await rig.member()).lost_reason is None
    assert outcome(await rig.run("two")) == ("RESTORED", "succeeded", None)
    assert rig.script.messages == ["one", "two"]


async def test_a_handshake_that_never_answers_times_out(rig: Rig) -> None:
    rig.script.handshakes = ["hang"]
    ns = await rig.run("never sent")
    assert (ns.outcome.value, ns.reason, ns.settlement.detail) == ("not_settled", "handshake_timeout",
                                                                   "no handshake within 0.5s")
    assert not rig.resident and rig.script.messages == []


# -- launch slots (CLOUD_AGENT_MAX_LAUNCHES) -----------------------------------------------------------

async def test_launches_past_the_slots_wait_and_their_wait_is_not_the_handshake_timeout(tmp_path) -> None:
    """Three members launch at once through one slot; each handshake takes 0.3 s of the 0.5 s
    timeout. They start one after another (never two handshakes at once), so the last one
    waits 0.6 s for its slot and still succeeds: only its own handshake is timed."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    slots = LaunchSlots(1, registry)
    async with make_rig(tmp_path, launch_slots=slots) as rig:
        rig.script.handshakes = [0.3, 0.3, 0.3]
        rig.script.turns = [settled(), settled(), settled()]
        receipts: dict[str, Receipt] = {}

        async def launch(member: str) -> None:
            receipts[member] = await rig.run(f"hello from {member}", member_id=member)

        async with anyio.create_task_group() as tg:
            for member in ("m1", "m2", "m3"):
                tg.start_soon(launch, member)
        assert {m: outcome(r) for m, r in receipts.items()} == {m: ("NEW", "succeeded", None)
                                                               for m in ("m1", "m2", "m3")}
        assert rig.script.most_handshaking == 1
        assert registry.get_sample_value("cloud_agent_launch_slot_waits_total", {"runtime": "codex"}) == 2
        assert registry.get_sample_value("cloud_agent_launches_starting") == 0
        for member in ("m1", "m2", "m3"):
            await rig.pool.retire((KEY[0], KEY[1], member), "test over")


async def test_a_failed_handshake_gives_its_slot_back(tmp_path) -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    async with make_rig(tmp_path, launch_slots=LaunchSlots(1, registry)) as rig:
        rig.script.handshakes = ["hang", HandshakeFailed(HandshakeReason.PROCESS_FAILED, "died"), None]
        rig.script.turns = [settled()]
        assert outcome(await rig.run("never sent")) == ("NEW", "not_settled", "handshake_timeout")
        assert outcome(await rig.run("never sent")) == ("NEW", "not_settled", "handshake_process_failed")
        with anyio.fail_after(2):  # a slot kept by either failure would hold this launch for ever
            assert outcome(await rig.run("one")) == ("NEW", "succeeded", None)
        assert registry.get_sample_value("cloud_agent_launch_slot_waits_total", {"runtime": "codex"}) is None
        assert rig.script.messages == ["one"]


# -- the claim reaches the disk before the CLI's input (runner.claim_on_disk) --------------------------


async def test_the_cli_gets_the_message_only_once_the_claim_is_on_disk(rig: Rig) -> None:
    rig.script.turns = [settled(), settled()]
    await rig.run("one")
    waiting, release = anyio.Event(), anyio.Event()

    async def on_disk() -> None:
        waiting.set()
        await release.wait()

    receipts: list[Receipt] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _append(receipts, rig.run("two", claim_on_disk=on_disk)))
        with anyio.fail_after(5):
            await waiting.wait()
        # the turn got ready (its status is out) while the claim was flushed, and waits for it
        assert rig.events[-1] == {"type": "status", "context_status": "LIVE"}
        assert rig.script.messages == ["one"]
        release.set()
    assert outcome(receipts[0]) == ("LIVE", "succeeded", None)
    assert rig.script.messages == ["one", "two"]


async def test_a_claim_that_cannot_reach_the_disk_fails_the_job_before_the_cli_sees_it(rig: Rig) -> None:
    from runner.claim_on_disk import ClaimOnDisk
    from state.contract import StoreUnavailable
    from state.records import JobState

    rig.script.turns = [settled(), settled()]
    await rig.run("one")

    async def broken_disk() -> None:
        raise OSError(5, "Input/output error")

    on_disk = ClaimOnDisk()
    await on_disk.flush(broken_disk)
    with pytest.raises(StoreUnavailable, match="did not reach the disk: OSError.5, 'Input/output error'"):
        await rig.run("two", claim_on_disk=on_disk.wait)
    assert rig.script.messages == ["one"]
    job = await rig.store.get_job(KEY[0], "job-1")
    assert job is not None and (job.state, job.receipt_json) == (JobState.RUNNING, None)  # the supervisor closes it


class RecordingKeepers:
    """The runner's keepers as far as a LIVE turn on a keeper resident uses them: the turn's
    record before its opening (``begin_turn``, which returns once the input may go and raises a
    failed wait as InputNotReady, as ``runner.keepers`` does: test_keeper_notes), none between
    turns."""

    def __init__(self, script: Script, claim_pending: Callable[[], bool]) -> None:
        self.script, self.claim_pending = script, claim_pending
        self.began: list[tuple[str, bool, int]] = []  # (job, claim still on its way, messages the CLI had)
        self.release = anyio.Event()

    async def begin_turn(self, key: Any, runtime: str, handle: Any, session: Any, job: Job, start: Any, *,
                         input_ready: Callable[[], Awaitable[None]], **_: Any) -> None:
        self.began.append((job.job_id, self.claim_pending(), len(self.script.messages)))
        await self.release.wait()
        try:
            await input_ready()
        except Exception as exc:
            raise InputNotReady(exc) from exc

    def after_turn(self, *_: Any) -> None:
        return None


def as_keeper_resident(rig: Rig, claim_pending: Callable[[], bool]) -> RecordingKeepers:
    keepers = RecordingKeepers(rig.script, claim_pending)
    rig.runner.keepers = keepers  # type: ignore[assignment]
    rig.pool.get(KEY).keeper = object()  # the resident runs under a keeper
    return keepers


async def test_a_keeper_residents_turn_record_is_written_while_the_claim_reaches_the_disk(rig: Rig) -> None:
    """Both come before the CLI's input, neither after the other: the record is begun while
    the claim's flush is still on its way, and the message goes once both are done."""
    rig.script.turns = [settled(), settled()]
    await rig.run("one")
    on_disk = anyio.Event()
    keepers = as_keeper_resident(rig, lambda: not on_disk.is_set())
    receipts: list[Receipt] = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: _append(receipts, rig.run("two", claim_on_disk=on_disk.wait)))
        with anyio.fail_after(5):
            while not keepers.began:
                await anyio.sleep(0.01)
        assert keepers.began == [("job-1", True, 1)]  # begun beside the flush, before the input
        on_disk.set()
        await anyio.sleep(0.05)
        assert rig.script.messages == ["one"]  # the record is not done yet: no input
        keepers.release.set()
    assert outcome(receipts[0]) == ("LIVE", "succeeded", None)
    assert rig.script.messages == ["one", "two"]


async def test_a_keeper_residents_claim_that_cannot_reach_the_disk_fails_before_the_cli_sees_it(rig: Rig) -> None:
    """The same failure as without a keeper: StoreUnavailable raised as itself past the turn, no
    receipt (the supervisor closes the job), nothing sent to the CLI."""
    from runner.claim_on_disk import ClaimOnDisk
    from state.contract import StoreUnavailable
    from state.records import JobState

    rig.script.turns = [settled(), settled()]
    await rig.run("one")
    keepers = as_keeper_resident(rig, lambda: False)
    keepers.release.set()

    async def broken_disk() -> None:
        raise OSError(5, "Input/output error")

    on_disk = ClaimOnDisk()
    await on_disk.flush(broken_disk)
    with pytest.raises(StoreUnavailable, match="did not reach the disk: OSError.5, 'Input/output error'"):
        await rig.run("two", claim_on_disk=on_disk.wait)
    assert (rig.script.messages, [b[0] for b in keepers.began]) == (["one"], ["job-1"])
    job = await rig.store.get_job(KEY[0], "job-1")
    assert job is not None and (job.state, job.receipt_json) == (JobState.RUNNING, None)


async def _append(out: list[Receipt], receipt: Any) -> None:
    out.append(await receipt)


async def test_a_commit_judged_twice_counts_its_verdict_once(rig: Rig, monkeypatch) -> None:
    """A store that retries the commit (PostgreSQL after a serialization failure) runs the
    decision once per attempt; the verdict metric counts the one that stood."""
    rig.script.turns = [settled(), settled()]
    registry = rig.runner.model_path.verdict_metrics.registry
    settle_job = rig.store.settle_job

    async def retrying(user_id, job_id, query, decide, *, sync=True):
        decide(await rig.store.wire_settle_view(user_id, job_id, query))  # rolled back
        await settle_job(user_id, job_id, query, decide, sync=sync)

    monkeypatch.setattr(rig.store, "settle_job", retrying)
    first = await rig.run("one")
    second = await rig.run("two")
    histories = {r.wire.history for r in (first, second) if r.wire}
    assert [registry.get_sample_value("cloud_agent_wire_verdicts_total", {"runtime": "codex", "history": h})
            for h in histories] == [2.0]


async def test_retiring_a_process_already_gone_is_not_a_warning(rig: Rig, monkeypatch) -> None:
    from structlog.testing import capture_logs

    from drivers.transport import TransportClosed

    rig.script.turns = [settled()]
    await rig.run()

    async def gone(self: FakeSession, grace_s: float = 3.0) -> None:
        # what a keeper link says when the sandbox was stopped under its process
        raise TransportClosed("the keeper link ended at offset 17184 before the CLI's output did")

    monkeypatch.setattr(FakeSession, "close", gone)
    with capture_logs() as logs:
        await rig.pool.retire(KEY, "test")
    ends = [(e["event"], e["log_level"]) for e in logs if e["event"].startswith("resident.")]
    assert ends[:2] == [("resident.already_gone", "info"), ("resident.retired", "info")]
