"""Readiness reasons and the attestation document, with a fake engine and supervisor."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from runner.openapi import API_VERSION
from tests.unit.attestation_fakes import IMAGE, FakeEngine, make_attestor, pinned_labels

pytestmark = pytest.mark.anyio


async def test_ready_only_after_a_passing_probe(tmp_path) -> None:
    att = make_attestor(tmp_path, FakeEngine())
    assert await att.readiness() == (["reverse_probe_pending"],
                                     {"reverse_probe_pending": "no reverse probe has finished yet"})
    await att.probe()
    assert await att.readiness() == ([], {})


async def test_an_image_with_an_older_helper_never_reports_ready(tmp_path) -> None:
    att = make_attestor(tmp_path, FakeEngine(labels=pinned_labels(helper="3")))
    await att.probe()
    reasons, detail = await att.readiness()
    assert reasons == ["helper_pin_mismatch", "reverse_probe_failed"]
    assert detail["helper_pin_mismatch"] == "image has http-agent-live-bridge=3, the pin is 4"
    assert detail["reverse_probe_failed"].startswith("image_inspect: ImageRefused: image cloud-agent-sandbox:fake")


async def test_an_image_without_the_helper_label_is_not_ready(tmp_path) -> None:
    labels = pinned_labels()
    del labels["http-agent-live-bridge"]
    att = make_attestor(tmp_path, FakeEngine(labels=labels))
    await att.probe()
    reasons, detail = await att.readiness()
    assert reasons[0] == "helper_pin_mismatch"
    assert detail["helper_pin_mismatch"] == "image has http-agent-live-bridge=None, the pin is 4"


async def test_other_pin_labels_are_named_separately(tmp_path) -> None:
    labels = pinned_labels()
    labels["org.cloud-agent.cli.codex"] = "@openai/codex@0.170.0"
    att = make_attestor(tmp_path, FakeEngine(labels=labels))
    await att.probe()
    reasons, detail = await att.readiness()
    assert reasons == ["image_pins_mismatch", "reverse_probe_failed"]
    assert detail["image_pins_mismatch"] == ("label org.cloud-agent.cli.codex=@openai/codex@0.170.0 "
                                             "(want @openai/codex@0.171.0)")


async def test_engine_unreachable(tmp_path) -> None:
    engine = FakeEngine()
    att = make_attestor(tmp_path, engine)
    await att.probe()
    engine.reachable = False
    assert (await att.readiness())[0] == ["engine_unreachable"]  # the last probe passed: only the engine
    await att.probe()
    reasons, detail = await att.readiness()
    assert reasons == ["engine_unreachable", "reverse_probe_failed"]
    assert detail["reverse_probe_failed"] == "ping: ProbeFailed: the engine did not answer a ping"
    doc = await att.document()
    assert doc["engine"] == {"reachable": False, "error": "EngineError: connection refused", "data_root_id": None}


async def test_unknown_source_sha(tmp_path) -> None:
    att = make_attestor(tmp_path, FakeEngine(), sha=None)
    await att.probe()
    assert await att.readiness() == (["source_sha_unknown"], {
        "source_sha_unknown": "neither git nor a SOURCE_SHA file names the running source"})


async def test_a_stale_probe_result_is_not_evidence(tmp_path) -> None:
    att = make_attestor(tmp_path, FakeEngine(), probe_interval_s=1, probe_timeout_s=1)
    await att.probe()
    assert att.probe_stale_after_s == 3
    att.prober.last.finished_at -= timedelta(seconds=4)
    reasons, detail = await att.readiness()
    assert reasons == ["reverse_probe_stale"] and detail["reverse_probe_stale"] == "last probe 4s ago"
    assert att.probe_document()["stale"] is True


async def test_a_stale_or_missing_heartbeat(tmp_path) -> None:
    att = make_attestor(tmp_path, FakeEngine(), beat_age_s=None)
    await att.probe()
    assert await att.readiness() == (["heartbeat_stale"], {"heartbeat_stale": "no beat yet"})
    att.sup.heartbeat.last_beat = datetime.now(UTC) - timedelta(seconds=26)
    assert (await att.readiness())[0] == ["heartbeat_stale"]  # 2 x 10 s interval + 5 s grace
    att.sup.heartbeat.last_beat = datetime.now(UTC) - timedelta(seconds=20)
    assert await att.readiness() == ([], {})


async def test_the_document(tmp_path) -> None:
    att = make_attestor(tmp_path, FakeEngine(), beat_age_s=2.0)
    await att.probe()
    doc = await att.document()
    assert doc["source"]["sha"] == "a" * 40 and doc["source"]["dirty"] is False
    assert doc["api_version"] == API_VERSION and doc["host_id"] == "host-a"
    assert doc["image"] == {"ref": IMAGE, "id": "sha256:" + "ab" * 32, "digest": "sha256:" + "ab" * 32,
                            "tags": [IMAGE], "labels": pinned_labels(), "helper_version": "4", "problems": []}
    assert doc["required_helper"] == {"name": "http-agent-live-bridge", "version": 4}
    assert doc["engine"] == {"reachable": True, "version": "20.10.24", "api_version": "1.41",
                             "data_root_id": "root-1"}
    probe = doc["reverse_probe"]
    assert probe["ok"] is True and probe["stale"] is False and probe["interval_s"] == 60
    assert set(probe["steps_ms"]) == {"ping", "sweep", "data_root", "image_inspect", "create", "start", "exec", "helper",
                                      "remove", "total"}
    hb = doc["heartbeat"]
    assert (hb["interval_s"], hb["beats"], hb["stale"]) == (10, 1, False) and 2.0 <= hb["age_s"] < 5
    assert doc["dependencies"] == {"control_plane": None}
    assert doc["readiness"] == {"ready": True, "reasons": [], "detail": {}}
