"""The sandbox image's identity: its tag (derived from the build inputs) and its labels.

Split from ``images.build`` so the daemon learns which image it runs without importing
the build script: the tag is a digest of the pins file, the Dockerfile (and the helper
compiler it runs) and the in-image helpers, so a pin change names a new image and an
unchanged input set names the same one.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from images.pins import PINS_FILE, Pins

SANDBOX_DIR = Path(__file__).with_name("sandbox")
DOCKERFILE = SANDBOX_DIR / "Dockerfile"
COMPILE_HELPERS = SANDBOX_DIR / "compile_helpers.py"  # run by the build: an input of the image
HELPERS_DIR = SANDBOX_DIR / "helpers"
IMAGE_REPO = "cloud-agent-sandbox"
INPUTS_LABEL = "org.cloud-agent.inputs"


def input_hash(*parts: bytes) -> str:
    """A digest of byte strings, length-prefixed so that part boundaries count."""
    h = hashlib.sha256()
    for p in parts:
        h.update(len(p).to_bytes(8, "big"))
        h.update(p)
    return h.hexdigest()


def helper_files() -> list[Path]:
    return sorted(p for p in HELPERS_DIR.iterdir() if p.is_file())


def carries_bridge(pins: Pins) -> bool:
    """The image claims the helper (label) only when it really carries it."""
    return (HELPERS_DIR / pins.helper.name).is_file()


def image_tag(pins_file: Path = PINS_FILE) -> str:
    """The tag the inputs build (default: the product's pins, what the supervisor runs). Another
    pins file (an upgrade test's) names another image: the tag digests the file's bytes."""
    parts = [pins_file.read_bytes(), DOCKERFILE.read_bytes(), COMPILE_HELPERS.read_bytes()]
    for f in helper_files():
        parts += [f.name.encode(), f.read_bytes()]
    return f"{IMAGE_REPO}:{input_hash(*parts)[:16]}"


def image_labels(pins: Pins, tag: str) -> dict[str, str]:
    """Every pin as a label (attestation and the sandbox manager read them back), plus the inputs digest."""
    labels = pins.labels(with_helper=carries_bridge(pins))
    labels[INPUTS_LABEL] = tag.split(":", 1)[1]
    return labels
