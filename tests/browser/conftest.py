"""Browser tests: where their screenshots went, printed at the end of the run."""

from __future__ import annotations

from tests.browser.browser import artifacts_dir

_RAN: list[bool] = []


def pytest_runtest_logreport(report) -> None:  # noqa: ANN001 - pytest hook
    if report.when == "call" and report.nodeid.startswith("tests/browser/"):
        _RAN.append(True)


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 - pytest hook
    shots = sorted(artifacts_dir().glob("*.png")) if _RAN else []
    if shots:
        terminalreporter.section("browser artifacts")
        terminalreporter.write_line(f"screenshots in {artifacts_dir()}:")
        for path in shots:
            terminalreporter.write_line(f"  {path.name}")
