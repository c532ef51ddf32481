"""The pinned versions of the sandbox image, loaded from ``images/pins.toml`` (the one pins file)."""

from __future__ import annotations

import tomllib
from functools import lru_cache
from pathlib import Path

from pydantic import BaseModel, ConfigDict

PINS_FILE = Path(__file__).with_name("pins.toml")

RUNTIMES = ("claude", "codex", "pi", "opencode", "kilo")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class BasePin(_Frozen):
    suite: str
    mirror: str
    packages: tuple[str, ...]


class NodePin(_Frozen):
    package: str
    version: str
    npm: str


class CliPin(_Frozen):
    package: str
    version: str
    version_command: tuple[str, ...]

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


class HelperPin(_Frozen):
    name: str
    version: int


class Pins(_Frozen):
    base: BasePin
    node: NodePin
    cli: dict[str, CliPin]
    helper: HelperPin

    def labels(self, *, with_helper: bool) -> dict[str, str]:
        """Image labels carrying every pin (attestation reads them from the image)."""
        labels = {
            "org.cloud-agent.node": self.node.version,
            "org.cloud-agent.npm": self.node.npm,
            "org.cloud-agent.base": f"debian-{self.base.suite}",
        }
        for runtime, pin in self.cli.items():
            labels[f"org.cloud-agent.cli.{runtime}"] = pin.spec
        if with_helper:
            labels[self.helper.name] = str(self.helper.version)
        return labels


def cli_version_from_labels(labels: dict[str, str], runtime: str) -> str | None:
    """The CLI version an image carries, from its pin label (``package@version``)."""
    spec = labels.get(f"org.cloud-agent.cli.{runtime}")
    return spec.rsplit("@", 1)[1] if spec and "@" in spec[1:] else None


@lru_cache(maxsize=4)
def load_pins(path: Path = PINS_FILE) -> Pins:
    with path.open("rb") as fh:
        return Pins.model_validate(tomllib.load(fh))

