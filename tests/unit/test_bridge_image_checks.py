"""images.checks.check_image_labels refuses an image whose live-bridge label is not the pinned
helper version (SPEC section 6), as well as mismatched CLI pins."""

from __future__ import annotations

from images.checks import check_image_labels
from images.pins import load_pins
from tests.support.bridge_replay import bridge_module


def good() -> dict[str, str]:
    return load_pins().labels(with_helper=True)


def test_the_helper_script_is_the_pinned_version() -> None:
    assert bridge_module().BRIDGE_VERSION == load_pins().helper.version == 4


def test_matching_labels_have_no_problems() -> None:
    assert check_image_labels(good()) == []
    assert good()["http-agent-live-bridge"] == "4"


def test_an_older_or_newer_helper_is_refused() -> None:
    for version in ("3", "5", ""):
        problems = check_image_labels(good() | {"http-agent-live-bridge": version})
        assert len(problems) == 1 and "http-agent-live-bridge" in problems[0], problems


def test_a_missing_helper_label_is_refused() -> None:
    labels = good()
    del labels["http-agent-live-bridge"]
    [problem] = check_image_labels(labels)
    assert "http-agent-live-bridge" in problem and "missing" in problem


def test_cli_pins_must_match() -> None:
    labels = good() | {"org.cloud-agent.cli.kilo": "@kilocode/cli@7.8.1"}
    del labels["org.cloud-agent.cli.opencode"]
    problems = check_image_labels(labels)
    assert len(problems) == 2
    assert any("kilo" in p and "7.8.1" in p for p in problems)
    assert any("opencode" in p and "missing" in p for p in problems)
