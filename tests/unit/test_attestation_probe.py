"""The reverse probe with a fake engine: steps and timings, and no probe container ever leaks."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import anyio
import pytest

from runner.probe import PROBE_LABEL
from sandbox_manager.engine import EngineError
from sandbox_manager.identity import LABEL_HOST, LABEL_SANDBOX
from tests.unit.attestation_fakes import FakeEngine, make_attestor, pinned_labels

pytestmark = pytest.mark.anyio

STEPS = ["ping", "sweep", "data_root", "image_inspect", "create", "start", "exec", "helper", "remove", "total"]


async def test_a_passing_probe_times_every_step_and_removes_its_container(tmp_path) -> None:
    engine = FakeEngine()
    att = make_attestor(tmp_path, engine)
    result = await att.probe()
    assert (result.ok, result.failed_step, result.error, result.removed) == (True, None, None, True)
    assert list(result.steps_ms) == STEPS
    assert result.helper_binary_version == "4" and result.image_id == "sha256:" + "ab" * 32
    assert engine.containers == {}
    spec = engine.last_spec
    # only the probe label: never a sandbox or host label that reap_orphans or a chat could pick up
    assert spec.labels == {PROBE_LABEL: "host-a"}
    assert LABEL_SANDBOX not in spec.labels and LABEL_HOST not in spec.labels
    assert (spec.mounts, spec.user, spec.pids_limit, spec.memory_bytes) == ((), "agent", 64, 256 * 1024**2)
    assert spec.name.startswith("ca-probe-")
    assert att.prober.last is result


@pytest.mark.parametrize(("step", "exc"), [("start", EngineError("start failed")),
                                           ("exec", EngineError("exec failed"))])
async def test_a_failing_step_is_named_and_the_container_is_still_removed(tmp_path, step, exc) -> None:
    engine = FakeEngine(fail={step: exc})
    result = await make_attestor(tmp_path, engine).probe()
    assert (result.ok, result.failed_step, result.error) == (False, step, f"EngineError: {exc}")
    assert result.removed and engine.containers == {}


async def test_create_that_raises_after_creating_is_cleaned_up_by_name(tmp_path) -> None:
    engine = FakeEngine(create_then_raise=True)
    result = await make_attestor(tmp_path, engine).probe()
    assert (result.ok, result.failed_step) == (False, "create")
    assert engine.containers == {} and "remove" in engine.calls


async def test_an_engine_without_a_data_root_identity_fails_the_probe(tmp_path) -> None:
    engine = FakeEngine(data_root=None)
    result = await make_attestor(tmp_path, engine).probe()
    assert (result.ok, result.failed_step, result.error) == (
        False, "data_root", "RuntimeError: the engine data root has no identity and none could be created")
    assert "create" not in engine.calls


async def test_wrong_exec_output_fails_the_exec_step(tmp_path) -> None:
    engine = FakeEngine(exec_output=b"0\n")
    result = await make_attestor(tmp_path, engine).probe()
    assert (result.ok, result.failed_step, result.error) == (
        False, "exec", "ProbeFailed: ca-launch id -u exited 0: b'0\\n'")
    assert engine.containers == {}


@pytest.mark.parametrize(("output", "error"), [
    (b"3\n", "ProbeFailed: the helper binary is version 3, the image label says 4"),
    (b"missing\n", "ProbeFailed: the image claims http-agent-live-bridge=4 but has no such helper"),
])
async def test_the_helper_binary_must_match_the_label(tmp_path, output, error) -> None:
    engine = FakeEngine(helper_output=output)
    result = await make_attestor(tmp_path, engine).probe()
    assert (result.ok, result.failed_step, result.error) == (False, "helper", error)
    assert engine.containers == {}


async def test_an_image_with_an_older_helper_is_refused_before_any_container(tmp_path) -> None:
    engine = FakeEngine(labels=pinned_labels(helper="3"))
    result = await make_attestor(tmp_path, engine).probe()
    assert (result.ok, result.failed_step) == (False, "image_inspect")
    assert result.error.startswith("ImageRefused: image cloud-agent-sandbox:fake")
    assert "label http-agent-live-bridge=3 (want 4)" in result.error
    assert "create" not in engine.calls and engine.containers == {}


async def test_a_hanging_exec_times_out_and_still_removes_the_container(tmp_path) -> None:
    engine = FakeEngine(hang={"exec"})
    att = make_attestor(tmp_path, engine, probe_timeout_s=0.3)
    with anyio.fail_after(5):
        result = await att.probe()
    assert (result.ok, result.failed_step, result.error) == (False, "exec", "timed out after 0.3s")
    assert result.removed and engine.containers == {}


async def test_cancelling_the_probe_mid_exec_removes_the_container(tmp_path) -> None:
    engine = FakeEngine(hang={"exec"})
    att = make_attestor(tmp_path, engine)
    with anyio.move_on_after(0.2):
        await att.probe()
    assert engine.containers == {} and att.prober.last is None


async def test_a_container_that_cannot_be_removed_is_reported_and_swept_next_time(tmp_path) -> None:
    engine = FakeEngine(fail={"remove": EngineError("engine busy")})
    att = make_attestor(tmp_path, engine, probe_timeout_s=0.5)
    first = await att.probe()
    assert first.ok and not first.removed and len(engine.containers) == 1
    (leftover,) = engine.containers.values()
    engine.fail.clear()
    # too young to be swept: a probe in flight elsewhere looks exactly like this
    second = await att.probe()
    assert second.swept == 0 and leftover.name in engine.containers
    engine.containers[leftover.name] = leftover.__class__(**{**leftover.__dict__, "attrs": {
        "Created": (datetime.now(UTC) - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%S.%f") + "999Z"}})
    third = await att.probe()
    assert third.ok and third.swept == 1 and engine.containers == {}


async def test_the_sweep_leaves_other_hosts_and_sandboxes_alone(tmp_path) -> None:
    engine = FakeEngine()
    old = datetime.now(UTC) - timedelta(hours=1)
    engine.add("ca-probe-other-host", {PROBE_LABEL: "host-b"}, old)
    engine.add("ca-sandbox", {LABEL_SANDBOX: "1", LABEL_HOST: "host-a"}, old)
    engine.add("ca-probe-killed", {PROBE_LABEL: "host-a"}, old)
    result = await make_attestor(tmp_path, engine).probe()
    assert result.ok and result.swept == 1
    assert sorted(engine.containers) == ["ca-probe-other-host", "ca-sandbox"]


async def test_probes_never_overlap(tmp_path) -> None:
    engine = FakeEngine()
    att = make_attestor(tmp_path, engine)
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(att.probe)
    creates = [c for c in engine.calls if c in ("create", "remove")]
    assert creates == ["create", "remove"] * 3
