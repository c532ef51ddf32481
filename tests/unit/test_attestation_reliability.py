"""deploy.reliability's checks on attestation documents, the table, and usage errors."""

from __future__ import annotations

import copy

import pytest

from deploy import reliability
from deploy.reliability import Check, render, run_checks
from tests.unit.attestation_fakes import pinned_labels

SHA = "0123456789abcdef0123456789abcdef01234567"
DOC = {
    "source": {"sha": SHA, "dirty": False, "origin": "git"},
    "api_version": "1",
    "image": {"ref": "cloud-agent-sandbox:x", "id": "sha256:" + "ab" * 32, "labels": pinned_labels()},
    "required_helper": {"name": "http-agent-live-bridge", "version": 4},
    "reverse_probe": {"ok": True, "age_s": 3.0, "stale": False, "stale_after_s": 180.0, "failed_step": None,
                      "error": None, "steps_ms": {"ping": 1, "create": 200, "total": 201}},
    "heartbeat": {"age_s": 1.5, "interval_s": 10.0},
}


def checks(doc=DOC, **kw) -> dict[str, Check]:
    kw = {"expect_sha": SHA, "max_heartbeat_age_s": 30.0} | kw
    return {c.name: c for c in run_checks(doc, **kw)}


def edited(**paths) -> dict:
    doc = copy.deepcopy(DOC)
    for path, value in paths.items():
        *parents, leaf = path.split("__")
        node = doc
        for p in parents:
            node = node[p]
        node[leaf] = value
    return doc


def test_all_pass() -> None:
    got = checks()
    assert [(c.name, c.result) for c in got.values()] == [
        ("source_sha", "pass"), ("helper_pin", "pass"), ("reverse_probe", "pass"), ("heartbeat", "pass")]
    assert got["source_sha"].detail == f"{SHA} (clean tree)"
    assert got["helper_pin"].detail == "image cloud-agent-sandbox:x (sha256:abababababab) has http-agent-live-bridge=4"
    assert got["reverse_probe"].detail == "passed 3.0s ago in 201 ms (ping 1, create 200)"
    assert got["heartbeat"].detail == "last beat 1.5s ago (interval 10.0s, max age 30s)"


def test_sha_failures() -> None:
    assert checks(expect_sha="f" * 40)["source_sha"] == Check(
        "source_sha", "fail", f"expected {'f' * 40}, the host serves {SHA}")
    assert checks(expect_sha=SHA.upper())["source_sha"].passed
    dirty = edited(source__dirty=True)
    assert checks(dirty)["source_sha"] == Check("source_sha", "fail",
                                                f"{SHA} with a dirty tree (local changes on top of the commit)")
    assert checks(dirty, allow_dirty=True)["source_sha"] == Check("source_sha", "pass",
                                                                  f"{SHA} (dirty tree, allowed)")
    unknown = edited(source={"sha": None, "dirty": None, "origin": "unknown"})
    assert checks(unknown)["source_sha"].detail == "the host does not know its source SHA (origin unknown)"


def test_helper_failures() -> None:
    labels = pinned_labels(helper="3")
    got = checks(edited(image__labels=labels))["helper_pin"]
    assert got == Check("helper_pin", "fail", "image cloud-agent-sandbox:x (sha256:abababababab) has "
                                              "http-agent-live-bridge=3, the pin is 4")
    got = checks(edited(required_helper__version=3))["helper_pin"]
    assert got.detail == "the host requires http-agent-live-bridge=3, this release pins 4" and not got.passed
    got = checks(edited(image={"ref": "x", "error": "NotFound: no such image"}))["helper_pin"]
    assert got.detail == "image x unavailable: NotFound: no such image" and not got.passed


def test_probe_failures() -> None:
    failed = edited(reverse_probe__ok=False, reverse_probe__failed_step="exec", reverse_probe__error="boom")
    assert checks(failed)["reverse_probe"] == Check("reverse_probe", "fail", "failed at exec: boom")
    stale = edited(reverse_probe__stale=True, reverse_probe__age_s=200.0)
    assert checks(stale)["reverse_probe"].detail == "passed 200.0s ago, older than 180s"
    assert checks(max_probe_age_s=2.0)["reverse_probe"].detail == "passed 3.0s ago, older than 2s"
    assert checks(edited(reverse_probe=None))["reverse_probe"].detail == \
        "no reverse probe has finished on the host yet"


def test_heartbeat_failures() -> None:
    assert checks(max_heartbeat_age_s=1.0)["heartbeat"] == Check(
        "heartbeat", "fail", "last beat 1.5s ago (interval 10.0s, max age 1s)")
    assert checks(edited(heartbeat={"age_s": None}))["heartbeat"].detail == "the host has recorded no beat"


def test_render_names_each_failed_check() -> None:
    table = render([Check("api", "pass", "ok"), Check("source_sha", "fail", "expected a, the host serves b"),
                    Check("heartbeat", "fail", "old")])
    assert table.splitlines() == [
        "CHECK       RESULT  DETAIL",
        "api         pass    ok",
        "source_sha  fail    expected a, the host serves b",
        "heartbeat   fail    old",
        "FAILED: source_sha, heartbeat",
    ]


def test_usage_errors_exit_2(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.delenv("CLOUD_AGENT_SERVICE_TOKEN_FILE", raising=False)
    assert reliability.main(["http://127.0.0.1:9", "--expect-sha", SHA]) == 2
    assert capsys.readouterr().err == ("deploy.reliability: no service token: pass --token-file or set "
                                       "CLOUD_AGENT_SERVICE_TOKEN_FILE\n")
    missing = tmp_path / "nope"
    assert reliability.main(["http://127.0.0.1:9", "--expect-sha", SHA, "--token-file", str(missing)]) == 2
    assert capsys.readouterr().err == f"deploy.reliability: cannot read the token file {missing}: " \
                                      "No such file or directory\n"
    with pytest.raises(SystemExit) as exc:
        reliability.main(["http://127.0.0.1:9"])
    assert exc.value.code == 2


def test_an_unreachable_host_fails_api_and_skips_the_rest(tmp_path, capsys) -> None:
    token = tmp_path / "token"
    token.write_text("x" * 32)
    assert reliability.main(["http://127.0.0.1:9", "--expect-sha", SHA, "--token-file", str(token)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("api            fail    http://127.0.0.1:9/v1/attestation unreachable: ConnectError")
    assert lines[2:] == [f"{name:<13}  skip    not checked: no attestation document"
                         for name in ("source_sha", "helper_pin", "reverse_probe", "heartbeat")] + \
        ["FAILED: api, source_sha, helper_pin, reverse_probe, heartbeat"]


def test_smoke_runtimes_are_checked_before_anything_runs(capsys) -> None:
    from deploy.reliability import main

    with pytest.raises(SystemExit) as exc:
        main(["http://127.0.0.1:1", "--expect-sha", "0" * 40, "--smoke", "codex,nope"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "python -m deploy.reliability: error: argument --smoke: a comma-separated list of distinct runtimes of "
        "claude, codex, pi, opencode, kilo (got 'codex,nope')")
