"""Two pytest-xdist workers: the engine tiers on one, in order; the unit tier beside them.

``scripts/test`` runs ``-n 2``. Tests that share the Docker engine, its host-wide state (the
data-root identity, the sandbox image) and the machine's cores with real CLIs must not run
beside each other, so :class:`EngineApart` schedules all of them as one unit of work, which
one worker runs in collection order. (xdist's own ``--dist loadgroup`` cannot be used: with
pytest 9 its group suffix is written to a node attribute pytest no longer reads.)

Workers know markers, the controller only node ids: each worker writes the ids of the engine
tests it collected into a directory the controller made (all collect the same tests), and
the scheduler reads them once every worker has collected. The same directory carries the
modules' end reports (a worker's terminal output goes nowhere) for the controller to print.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

SHARED_ENV = "CLOUD_AGENT_TEST_SHARED"
ENGINE_MARKERS = frozenset({"docker", "cli", "regression", "browser", "fleet"})
ENGINE_IDS = "engine-ids.txt"


def in_worker(config: Any) -> bool:
    return hasattr(config, "workerinput")


def open_shared(config: Any) -> None:
    """In the controlling process, before the workers start (they inherit the variable)."""
    if not in_worker(config) and SHARED_ENV not in os.environ:
        os.environ[SHARED_ENV] = tempfile.mkdtemp(prefix="ca-tests-")


def _shared() -> Path | None:
    where = os.environ.get(SHARED_ENV)
    return Path(where) if where else None


def note_engine_tests(items: list[Any]) -> None:
    """On a worker: the ids of the collected tests that need the engine."""
    where = _shared()
    if where is None:
        return
    ids = [item.nodeid for item in items if ENGINE_MARKERS & {m.name for m in item.iter_markers()}]
    tmp = where / f"{ENGINE_IDS}.{os.getpid()}"
    tmp.write_text("\n".join(ids) + "\n")
    tmp.replace(where / ENGINE_IDS)


def engine_apart(config: Any, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class EngineApart(LoadScopeScheduling):
        """Every engine test in one scope (one worker, collection order); each unit test alone."""

        _engine: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._engine is None:
                where = _shared()
                path = where / ENGINE_IDS if where else None
                if path is None or not path.exists():
                    raise RuntimeError("no worker said which tests need the engine")
                self._engine = frozenset(path.read_text().split("\n")) - {""}
            return "engine" if nodeid in self._engine else nodeid

    return EngineApart(config, log)


def leave_report(name: str, lines: list[str]) -> None:
    where = _shared()
    if where is not None:
        (where / ("report-" + re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".txt")).write_text("\n".join(lines) + "\n")


def print_reports(terminalreporter: Any) -> None:
    where = _shared()
    if in_worker(terminalreporter.config) or where is None or not where.is_dir():
        return
    files = sorted(where.glob("report-*.txt"))
    if files:
        terminalreporter.section("module reports")
        for path in files:
            terminalreporter.write_line("")
            for line in path.read_text().splitlines():
                terminalreporter.write_line(line)
    shutil.rmtree(where, ignore_errors=True)
