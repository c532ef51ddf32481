"""The reverse probe's read of the helper's own version (runner.probe.HELPER_VERSION_SCRIPT),
run with ``sh`` as the probe runs it in the image: from the helper on PATH, from the source a
stub compiled at the image's build names (images/sandbox/compile_helpers.py), or ``missing``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from images.identity import COMPILE_HELPERS, HELPERS_DIR
from runner.probe import HELPER_VERSION_SCRIPT

BRIDGE = "http-agent-live-bridge"


def version(bin_dir: Path) -> str:
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    done = subprocess.run(["sh", "-c", HELPER_VERSION_SCRIPT, "sh", BRIDGE], capture_output=True, text=True,
                          env=env, timeout=30, check=True)
    assert done.stderr == ""
    return done.stdout


def test_the_version_of_a_helper_script_on_path(tmp_path) -> None:
    shutil.copy2(HELPERS_DIR / BRIDGE, tmp_path / BRIDGE)
    assert version(tmp_path) == "4\n"


def test_the_version_of_a_compiled_helper_is_read_from_the_source_its_stub_names(tmp_path) -> None:
    bin_dir, lib_dir = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    shutil.copy2(HELPERS_DIR / BRIDGE, bin_dir / BRIDGE)
    subprocess.run([sys.executable, "-I", "-S", str(COMPILE_HELPERS), str(bin_dir), str(lib_dir), BRIDGE],
                   check=True, timeout=60)
    assert "BRIDGE_VERSION" not in (bin_dir / BRIDGE).read_text()  # a stub: the line is in its source
    assert version(bin_dir) == "4\n"
    (lib_dir / f"{BRIDGE}.py").write_text((lib_dir / f"{BRIDGE}.py").read_text().replace(
        "BRIDGE_VERSION = 4", "BRIDGE_VERSION = 7"))
    assert version(bin_dir) == "7\n"
    (lib_dir / f"{BRIDGE}.py").unlink()  # a stub whose source is gone: no version, as for a file without one
    assert version(bin_dir) == "\n"


def test_an_absent_helper_is_missing(tmp_path) -> None:
    assert version(tmp_path) == "missing\n"
