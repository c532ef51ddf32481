"""Import direction (docs/architecture.md): every import of every product module, read with
``ast`` (function-level imports too), must point down the layer order; the daemon never imports
the loopback fixture nor the image build script; nothing outside tests/ imports tests."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# What each product package may import (besides itself and third-party code). Lower layers never
# import higher ones; siblings only where named.
MAY_IMPORT: dict[str, set[str]] = {
    "runner": {"drivers", "proxy", "sandbox_manager", "state", "images", "telemetry"},
    "drivers": {"telemetry"},  # bytes + CLI protocols: pins and helper paths come in launch inputs
    "proxy": {"state", "telemetry"},  # HTTP and unix sockets: no Docker, no drivers
    "sandbox_manager": {"state", "images", "telemetry"},  # Docker only
    "state": {"telemetry"},
    "images": {"telemetry"},
    "telemetry": set(),
    "deploy": {"images", "telemetry"},  # engine set-up, the loopback fixture, checks: never the runner
}
# The demo runs the loopback fixture and sets up the engine for the user (SPEC 10).
MODULE_EXCEPTIONS: dict[str, set[str]] = {"runner.demo": {"deploy"}}
# The daemon: `cloud-agent serve` and everything it imports.
DAEMON_ROOTS = ("runner.serve", "runner.supervisor", "runner.daemon")
NEVER_IN_THE_DAEMON = ("deploy.loopback", "images.build")


def product_packages() -> list[str]:
    return sorted(p.parent.name for p in REPO.glob("*/__init__.py") if p.parent.name != "tests")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str | None = None) -> set[str]:
    """Absolute names of every module ``path`` (module ``name``) imports, anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            found.add(mod)
            # `from pkg import sub` may name a submodule
            found.update(f"{mod}.{a.name}" for a in node.names)
    return found


def product_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in product_packages() for p in (REPO / pkg).rglob("*.py")}


MODULES = product_modules()


def test_every_product_package_has_a_place_in_the_order() -> None:
    assert set(product_packages()) <= set(MAY_IMPORT), set(product_packages()) - set(MAY_IMPORT)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_the_layers(module: str) -> None:
    own = module.split(".")[0]
    allowed = MAY_IMPORT[own] | {own} | MODULE_EXCEPTIONS.get(module, set())
    wrong = sorted(m for m in imports_of(MODULES[module])
                   if m.split(".")[0] in MAY_IMPORT and m.split(".")[0] not in allowed)
    assert wrong == [], f"{module} ({own}) imports against the layer order: {wrong}"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_nothing_outside_tests_imports_tests(module: str) -> None:
    assert sorted(m for m in imports_of(MODULES[module]) if m.split(".")[0] == "tests") == []


def daemon_closure() -> set[str]:
    seen: set[str] = set()
    todo = list(DAEMON_ROOTS)
    while todo:
        mod = todo.pop()
        if mod in seen or mod not in MODULES:
            continue
        seen.add(mod)
        todo.extend(m for m in imports_of(MODULES[mod]) if m in MODULES)
    return seen


def test_the_daemon_imports_neither_the_loopback_fixture_nor_the_build_script() -> None:
    closure = daemon_closure()
    assert {"runner.serve", "runner.supervisor", "runner.turn", "state.store"} <= closure  # control
    assert sorted(m for m in closure if m.startswith(NEVER_IN_THE_DAEMON)) == []


def test_the_checker_sees_a_wrong_arrow_anywhere_in_a_file(tmp_path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from images.pins import load_pins\n    if f:\n        import runner.turn\n"
                     "from ..codex import wire\n")
    assert {"images.pins", "runner.turn", "drivers.codex.wire"} <= imports_of(probe, "drivers.claude.probe")
