"""A launch's files come first on its exec's stdin (sandbox_manager.launch_files) and the
launcher writes them before anything else — ``ca-launch --files-on-stdin`` and ``ca-keeper run
--files-on-stdin`` — as the sandbox's own user; the rest of stdin is the CLI's, to the byte.
Real launcher and keeper scripts, run with this machine's python3."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox_manager.engine import FileEntry
from sandbox_manager.launch_files import encode
from tests.support.keeper_local import KEEPER

LAUNCHER = Path(__file__).resolve().parents[2] / "images" / "sandbox" / "helpers" / "ca-launch"


def launch(tmp_path: Path, stdin: bytes, *command: str) -> subprocess.CompletedProcess[bytes]:
    argv = [sys.executable, "-I", "-S", str(LAUNCHER), "--pidfile", str(tmp_path / "run" / "cli.pid"),
            "--files-on-stdin", "--", *(command or ("cat",))]
    return subprocess.run(argv, input=stdin, capture_output=True, check=False, timeout=30)


def test_the_encoding_is_records_after_a_sized_header() -> None:
    data = encode([FileEntry("/h/a.json", b"{}\n", 0o600)], [FileEntry("/h/keep", b"k")], ["/h/d"])
    body = b"D 755 0 /h/d\nF 600 3 /h/a.json\n{}\nK 644 1 /h/keep\nk"
    assert data == b"CA-FILES %d\n" % len(body) + body
    for bad in ("relative/path", "/two\nlines", "/nul\0"):
        with pytest.raises(ValueError, match="absolute, on one line and without NUL"):
            encode([FileEntry(bad, b"")], [], [])


def test_files_are_written_before_the_cli_starts_and_the_rest_of_stdin_is_the_clis(tmp_path) -> None:
    home = tmp_path / "home"
    (home / "kept").parent.mkdir(parents=True)
    (home / "kept").write_bytes(b"edited by the CLI")
    payload = bytes(range(256)) * 300  # past a pipe's buffer, and every byte value
    files = encode([FileEntry(f"{home}/cfg/a.json", b'{"a": 1}\n', 0o640), FileEntry(f"{home}/cfg/b", b"")],
                   [FileEntry(f"{home}/kept", b"default"), FileEntry(f"{home}/new-keep", b"default")],
                   [f"{tmp_path}/run", f"{home}/work"])
    done = launch(tmp_path, files + payload)
    assert (done.returncode, done.stderr) == (0, b"")
    assert done.stdout == payload  # cat: exactly what followed the files
    assert (home / "cfg" / "a.json").read_bytes() == b'{"a": 1}\n'
    assert oct((home / "cfg" / "a.json").stat().st_mode & 0o777) == oct(0o640)
    assert (home / "cfg" / "b").read_bytes() == b""
    assert (home / "kept").read_bytes() == b"edited by the CLI"  # K: never over a file the CLI has
    assert (home / "new-keep").read_bytes() == b"default"
    assert (home / "work").is_dir()
    assert sorted(p.name for p in (home / "cfg").iterdir()) == ["a.json", "b"]  # no temporary left


def test_a_symlink_where_a_file_goes_is_replaced_never_followed(tmp_path) -> None:
    target = tmp_path / "outside"
    target.write_bytes(b"not yours")
    (tmp_path / "h").mkdir()
    os.symlink(target, tmp_path / "h" / "cfg")
    done = launch(tmp_path, encode([FileEntry(f"{tmp_path}/h/cfg", b"mine")], [], []), "true")
    assert done.returncode == 0, done
    assert target.read_bytes() == b"not yours"
    assert not (tmp_path / "h" / "cfg").is_symlink() and (tmp_path / "h" / "cfg").read_bytes() == b"mine"


def test_files_that_cannot_be_written_are_a_launch_error_and_the_cli_never_starts(tmp_path) -> None:
    (tmp_path / "plain").write_bytes(b"a file, not a directory")
    marker = tmp_path / "started"
    cases = [
        (encode([FileEntry(f"{tmp_path}/plain/cfg", b"x")], [], []), f"{tmp_path}/plain/cfg", "File exists"),
        (b"CA-FILES 12\nD 755 0 /x\n", "-", "stdin ended 1 of 12 bytes before the launch's files did"),
        (b"CA-FILES 10\nD 755 0 /x", "-", "a bad record at byte 0 of the launch's files"),
        (b"hello\n", "-", "stdin did not start with the launch's files: b'hello\\n'"),
        (b"CA-FILES 11\nX 755 0 /x\n", "/x", "a bad record at byte 0 of the launch's files"),
    ]
    for stdin, path, detail in cases:
        done = launch(tmp_path, stdin, "touch", str(marker))
        assert done.returncode == 3, (stdin, done)
        assert json.loads(done.stdout) == {"type": "launch_error", "reason": "files_not_written", "path": path,
                                           "detail": detail}
        assert not marker.exists() and not (tmp_path / "run" / "cli.pid").exists()


def test_the_keepers_run_writes_them_before_it_forks_the_keeper(tmp_path) -> None:
    """``ca-keeper run --files-on-stdin``: written by the run process, then the keeper and its CLI
    start (the CLI reads the file the files just wrote); a refusal when they cannot be."""
    sock = tmp_path / "run" / "keeper.sock"
    base = [sys.executable, "-I", "-S", str(KEEPER), "run", "--socket", str(sock), "--keeper-pidfile",
            str(tmp_path / "run" / "keeper.pid"), "--files-on-stdin", "--pidfile", str(tmp_path / "run" / "cli.pid"),
            "--", "cat", str(tmp_path / "h" / "cfg")]
    (tmp_path / "plain").write_bytes(b"")
    refused = subprocess.run([*base[:-1], str(tmp_path / "plain")], input=encode(
        [FileEntry(f"{tmp_path}/plain/x", b"")], [], []), capture_output=True, timeout=30, check=False)
    assert refused.returncode == 4, refused
    kind, size = refused.stdout[:1], int.from_bytes(refused.stdout[1:5], "big")
    assert (kind, json.loads(refused.stdout[5:5 + size])) == (
        b"R", {"reason": "files_not_written", "detail": f"{tmp_path}/plain/x: File exists"})
    assert not sock.exists()
    run = subprocess.Popen(base, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert run.stdin is not None and run.stdout is not None
        attach = json.dumps({"protocol": 1, "from": 0}).encode()
        run.stdin.write(encode([FileEntry(f"{tmp_path}/h/cfg", b"written first\n")], [], [])
                        + b"A" + len(attach).to_bytes(4, "big") + attach)
        run.stdin.flush()
        seen = b""
        while b"written first\n" not in seen:  # the CLI's output, in the keeper's D frame
            chunk = os.read(run.stdout.fileno(), 65536)
            assert chunk, seen
            seen += chunk
    finally:
        run.kill()
        run.wait(timeout=10)
        keeper = (tmp_path / "run" / "keeper.pid").read_text().strip()
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(keeper), signal.SIGKILL)
