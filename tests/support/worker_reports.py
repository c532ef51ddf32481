"""Module reports across pytest-xdist workers.

``scripts/test`` runs the suite on two workers (the unit tier beside the engine tiers). A
worker's terminal output goes nowhere, so a report a module writes at its end (the
regression suites' matrices, measured figures) is left in a directory the controlling
process made, and the controller prints every one in its summary.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

REPORTS_ENV = "CLOUD_AGENT_TEST_REPORTS"


def in_worker(config: Any) -> bool:
    return hasattr(config, "workerinput")


def open_reports(config: Any) -> None:
    """In the controlling process, before the workers start (they inherit the variable)."""
    if not in_worker(config) and REPORTS_ENV not in os.environ:
        os.environ[REPORTS_ENV] = tempfile.mkdtemp(prefix="ca-test-reports-")


def leave_report(name: str, lines: list[str]) -> None:
    where = os.environ.get(REPORTS_ENV)
    if where:
        (Path(where) / (re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".txt")).write_text("\n".join(lines) + "\n")


def print_reports(terminalreporter: Any) -> None:
    where = os.environ.get(REPORTS_ENV)
    if in_worker(terminalreporter.config) or not where or not Path(where).is_dir():
        return
    files = sorted(Path(where).glob("*.txt"))
    if files:
        terminalreporter.section("module reports")
        for path in files:
            terminalreporter.write_line("")
            for line in path.read_text().splitlines():
                terminalreporter.write_line(line)
    shutil.rmtree(where, ignore_errors=True)
