"""The pinned image carries the live bridge (file + label); an image labelled with an older
helper version is refused by the image check the supervisor runs (images.checks)."""

from __future__ import annotations

import json
import subprocess

import pytest

from images.checks import check_image_labels
from images.identity import HELPERS_DIR
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
    # compiled at the build (images/sandbox/compile_helpers.py): the source it runs is kept
    out = docker_client.containers.run(sandbox_image, ["sh", "-c", "cat /usr/local/lib/cloud-agent/"
                                                       "http-agent-live-bridge.py; python3 --version"],
                                       remove=True, user="agent", network_mode="none").decode()
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


def test_every_helper_in_the_image_runs_the_code_of_its_committed_source(docker_client, sandbox_image) -> None:
    """Each helper is a stub over its code compiled at the build by the image's own python3;
    the code is that of the committed helper (its source kept beside it, byte for byte)."""
    names = sorted(p.name for p in HELPERS_DIR.iterdir() if p.is_file())
    assert names == ["ca-keeper", "ca-launch", "ca-modelgate", "http-agent-live-bridge"]
    probe = (
        "import json, marshal, sys\n"
        "out = {}\n"
        "for name in sys.argv[1:]:\n"
        "    lib = '/usr/local/lib/cloud-agent/' + name\n"
        "    src = open(lib + '.py', 'rb').read()\n"
        "    code = marshal.loads(open(lib + '.code', 'rb').read())\n"
        "    same = code.co_code == compile(src, lib + '.py', 'exec', dont_inherit=True).co_code\n"
        "    out[name] = [open('/usr/local/bin/' + name).read(), src.decode(), same, code.co_filename]\n"
        "print(json.dumps(out))\n"
    )
    got = json.loads(docker_client.containers.run(sandbox_image, ["python3", "-IS", "-c", probe, *names], remove=True,
                                                  user="agent", network_mode="none"))
    for name in names:
        stub, source, same, filename = got[name]
        committed = (HELPERS_DIR / name).read_text()
        assert source == committed and same and filename == f"/usr/local/lib/cloud-agent/{name}.py"
        assert stub.splitlines() == [committed.split("\n", 1)[0],
                                     f"# {name}: its code was compiled at the image's build (compile_helpers.py); "
                                     f"the source is /usr/local/lib/cloud-agent/{name}.py",
                                     f'exec(__import__("marshal").loads(open('
                                     f"'/usr/local/lib/cloud-agent/{name}.code', \"rb\").read()))"]
