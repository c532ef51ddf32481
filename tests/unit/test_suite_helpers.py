"""The suites' own helpers must not hide a broken runtime."""

from __future__ import annotations

import pytest

import drivers.registry
from tests.supervisor_helpers import available_runtimes


def test_every_registered_runtime_is_in_the_suites() -> None:
    assert available_runtimes() == ["claude", "codex", "pi", "opencode", "kilo"]
    assert available_runtimes() == list(drivers.registry.RUNTIMES)


def test_a_driver_that_fails_to_import_is_an_error_not_a_skip(monkeypatch) -> None:
    real = drivers.registry.get_driver

    def broken(runtime: str):
        if runtime == "pi":
            raise ImportError("cannot import name 'PiDriver' (a broken driver module)")
        return real(runtime)

    monkeypatch.setattr(drivers.registry, "get_driver", broken)
    with pytest.raises(ImportError, match="broken driver module"):
        available_runtimes()
