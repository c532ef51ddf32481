"""The pinned image carries the live bridge (file + label); an image labelled with an older
helper version is refused by the image check the supervisor runs (images.checks)."""

from __future__ import annotations

import json
import subprocess

import pytest

from images.checks import check_image_labels
from images.pins import load_pins
from tests.support.bridge_replay import BRIDGE_PATH

pytestmark = [pytest.mark.docker]

OLD_TAG = "cloud-agent-sandbox:bridge3-test"


def labels_of(docker_client, tag: str) -> dict[str, str]:
    return docker_client.images.get(tag).labels or {}


def test_image_carries_the_bridge(docker_client, sandbox_image) -> None:
    labels = labels_of(docker_client, sandbox_image)
    assert labels["http-agent-live-bridge"] == str(load_pins().helper.version) == "4"
    assert check_image_labels(labels) == []
    out = docker_client.containers.run(sandbox_image, ["sh", "-c", "cat /usr/local/bin/http-agent-live-bridge; "
                                                       "python3 --version"], remove=True, user="agent",
                                       network_mode="none").decode()
    assert out.startswith(BRIDGE_PATH.read_text())  # byte for byte the committed helper
    assert "Python 3.11" in out
    help_text = docker_client.containers.run(sandbox_image, ["http-agent-live-bridge", "--help"], remove=True,
                                             user="agent", network_mode="none").decode()
    assert "--runtime" in help_text


def test_an_image_with_helper_label_3_is_refused(docker_client, sandbox_image) -> None:
    dockerfile = f"FROM {sandbox_image}\nLABEL http-agent-live-bridge=3\n"
    subprocess.run(["docker", "build", "--network", "none", "-t", OLD_TAG, "-"], input=dockerfile.encode(),
                   check=True, capture_output=True, timeout=300)
    try:
        labels = labels_of(docker_client, OLD_TAG)
        assert labels["http-agent-live-bridge"] == "3"
        problems = check_image_labels(labels)
        assert len(problems) == 1 and "http-agent-live-bridge" in problems[0], json.dumps(problems)
    finally:
        subprocess.run(["docker", "rmi", "-f", OLD_TAG], capture_output=True, timeout=120)
