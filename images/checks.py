"""Is an image one the supervisor may run sandboxes from? (label checks against the pins)"""

from __future__ import annotations

from images.pins import Pins, load_pins


def check_image_labels(labels: dict[str, str], *, pins: Pins | None = None, require_helper: bool = True) -> list[str]:
    """Problems with an image's labels; empty when it carries exactly the pinned versions.

    The helper pin is exact: an image with an older (or newer) http-agent-live-bridge
    must never be used or report ready (SPEC section 6).
    """
    pins = pins or load_pins()
    problems: list[str] = []
    for key, want in pins.labels(with_helper=require_helper).items():
        got = labels.get(key)
        if got is None:
            problems.append(f"label {key} missing (want {want})")
        elif got != want:
            problems.append(f"label {key}={got} (want {want})")
    return problems
