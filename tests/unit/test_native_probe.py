"""The inspector's native-state probe asks each CLI's driver where its session state lives
(Driver.native_state) and lists what those patterns match. The probe's own script runs here
with sh over a temporary member home: the member's files are found, another session's are not."""

from __future__ import annotations

import subprocess
from datetime import UTC, datetime
from pathlib import Path

import pytest

from drivers.models import Locator, MemberPaths
from drivers.registry import RUNTIMES, get_driver
from runner.native_probe import _SCRIPT, parse_listing, session_words
from state.records import MemberRecord, SavedLocator

HOME = "/home/agent/members/166898a7e92363c2/home"  # SandboxManager.member_dirs("m1").home
CLAUDE_ID = "0b7e3c4e-1d2a-4c7a-9a55-1f0e6d2b9a11"
PI_FILE = f"{HOME}/.pi/agent/sessions/--home-agent-workspace--/2026-12-01T10-00-00-000Z_p1.jsonl"

# runtime -> (saved locator, the patterns the probe must list), for member m1
EXPECTED: dict[str, tuple[SavedLocator, list[str]]] = {
    "claude": (SavedLocator(id=CLAUDE_ID), [f"{HOME}/.claude/projects/-home-agent-workspace/{CLAUDE_ID}.jsonl"]),
    "codex": (SavedLocator(id="019a-thread"), [f"{HOME}/.codex/sessions/*/*/*/rollout-*-019a-thread.jsonl"]),
    "pi": (SavedLocator(id="p1", path=PI_FILE), [PI_FILE]),
    "opencode": (SavedLocator(id="ses_1"), [f"{HOME}/.local/share/opencode/opencode.db",
                                            f"{HOME}/.local/share/opencode/opencode.db-wal"]),
    "kilo": (SavedLocator(id="ses_2"), [f"{HOME}/.local/share/kilo/kilo.db", f"{HOME}/.local/share/kilo/kilo.db-wal"]),
}


def member(runtime: str, locator: SavedLocator | None) -> MemberRecord:
    now = datetime.now(UTC)
    return MemberRecord(user_id="u1", chat_id="c1", member_id="m1", runtime=runtime, locator=locator,
                        home_member_id="m1", created_at=now, updated_at=now)


def test_every_runtime_has_its_patterns() -> None:
    assert set(EXPECTED) == set(RUNTIMES)


@pytest.mark.parametrize("runtime", sorted(EXPECTED))
def test_the_driver_names_where_its_cli_keeps_the_session(runtime: str) -> None:
    saved, patterns = EXPECTED[runtime]
    assert session_words(runtime, member(runtime, saved)) == patterns


def test_no_locator_or_an_unknown_runtime_has_nothing_to_look_for() -> None:
    assert session_words("codex", member("codex", None)) == []
    assert session_words("sixth-cli", member("sixth-cli", SavedLocator(id="x"))) == []


def listing(home: Path, words: list[str]) -> tuple[int | None, int | None, list[str]]:
    done = subprocess.run(["sh", "-c", _SCRIPT, "sh", str(home), *words], capture_output=True, text=True,
                          check=True, timeout=30)
    files, size, found = parse_listing(done.stdout)
    return files, size, sorted(f.path for f in found)


def write(path: Path, text: str = "{}\n") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("runtime", sorted(EXPECTED))
def test_the_probe_lists_the_members_files_and_not_another_sessions(runtime: str, tmp_path: Path) -> None:
    home = tmp_path / "h[1]*"  # glob metacharacters in a path are matched literally
    paths = MemberPaths(home=str(home), workspace=str(tmp_path / "ws"), run_dir=str(tmp_path / "run"))
    driver = get_driver(runtime)
    mine = Locator(id="sess-mine", path=str(home / "sessions" / "mine.jsonl"))
    other = Locator(id="sess-other", path=str(home / "sessions" / "other.jsonl"))
    if runtime == "claude":
        want = [write(Path(driver.transcript(paths, mine)))]  # type: ignore[attr-defined]
        write(Path(driver.transcript(paths, other)))  # type: ignore[attr-defined]
    elif runtime == "codex":
        sessions = home / ".codex" / "sessions"
        want = [write(sessions / "2026" / "12" / "01" / "rollout-2026-12-01T10-00-00-sess-mine.jsonl")]
        write(sessions / "2026" / "12" / "01" / "rollout-2026-12-01T10-00-00-sess-other.jsonl")
    elif runtime == "pi":
        want = [write(Path(mine.path or ""))]
        write(Path(other.path or ""))
    else:  # one SQLite store (and its write-ahead log) holds every session of the server
        db = home / ".local" / "share" / runtime / f"{runtime}.db"
        want = [write(db), write(Path(f"{db}-wal"))]
        write(db.parent / "unrelated.db")
    files, size, found = listing(home, driver.native_state(paths, mine))
    assert found == sorted(want)
    assert files is not None and files == len(list(p for p in home.rglob("*") if p.is_file()))
    assert size is not None and size > 0
