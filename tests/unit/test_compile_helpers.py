"""The image build's helper compiler (images/sandbox/compile_helpers.py), run on copies of the
committed helpers with this machine's python3: each compiled helper behaves as its script did
(a keeper started through the compiled ca-keeper launches a CLI through the compiled ca-launch
next to it), its source is kept byte for byte, and a bad helper fails the build."""

from __future__ import annotations

import json
import marshal
import shutil
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

from images.identity import COMPILE_HELPERS, HELPERS_DIR, image_tag
from sandbox_manager.keeper import KeeperChannel
from sandbox_manager.keeper_sandbox import KeeperPaths, retire_argv, run_prefix
from tests.support.keeper_local import ProcessBytes, fake_cli_argv, open_client, reap

NAMES = ("ca-keeper", "ca-launch", "ca-modelgate", "http-agent-live-bridge")


def run_compiler(bin_dir: Path, lib_dir: Path, *names: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-I", "-S", str(COMPILE_HELPERS), str(bin_dir), str(lib_dir), *names],
                          capture_output=True, text=True, check=False, timeout=60)


@pytest.fixture
def compiled(tmp_path) -> tuple[Path, Path]:
    bin_dir, lib_dir = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    for name in NAMES:
        shutil.copy2(HELPERS_DIR / name, bin_dir / name)
    done = run_compiler(bin_dir, lib_dir, *NAMES)
    assert (done.returncode, done.stderr) == (0, "")
    return bin_dir, lib_dir


def python(script: Path, *args: str) -> list[str]:
    # the stub's own flags from its first line, this interpreter (the one that compiled it)
    flags = script.read_text().split("\n", 1)[0].split()[1:]
    return [sys.executable, *flags, str(script), *args]


def test_each_helper_becomes_a_stub_over_its_own_source_and_code(compiled) -> None:
    bin_dir, lib_dir = compiled
    assert sorted(p.name for p in lib_dir.iterdir()) == sorted([f"{n}.py" for n in NAMES] + [f"{n}.code" for n in NAMES])
    for name in NAMES:
        committed = (HELPERS_DIR / name).read_bytes()
        assert (lib_dir / f"{name}.py").read_bytes() == committed
        stub = (bin_dir / name).read_text().splitlines()
        assert len(stub) == 3 and stub[0] == committed.decode().split("\n", 1)[0]
        assert stub[2] == f'exec(__import__("marshal").loads(open({str(lib_dir / (name + ".code"))!r}, "rb").read()))'
        assert (bin_dir / name).stat().st_mode & 0o777 == 0o755
        code = marshal.loads((lib_dir / f"{name}.code").read_bytes())
        assert code.co_filename == str(lib_dir / f"{name}.py")  # tracebacks name the kept source
        assert code.co_code == compile(committed, str(lib_dir / f"{name}.py"), "exec", dont_inherit=True).co_code


def test_compiled_helpers_answer_as_their_scripts_do(compiled) -> None:
    bin_dir, _ = compiled
    for args in (["status", "--socket", "/nonexistent/keeper.sock"], ["frobnicate"]):
        got = subprocess.run(python(bin_dir / "ca-keeper", *args), capture_output=True, timeout=30)
        want = subprocess.run(python(HELPERS_DIR / "ca-keeper", *args), capture_output=True, timeout=30)
        assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
        assert got.returncode == 4
    got = subprocess.run(python(bin_dir / "ca-launch", "--pidfile", str(bin_dir.parent / "p"), "--", "echo", "hi"),
                         capture_output=True, timeout=30)
    assert (got.returncode, got.stdout) == (0, b"hi\n")
    got = subprocess.run(python(bin_dir / "http-agent-live-bridge", "--help"), capture_output=True, text=True,
                         timeout=30)
    assert got.returncode == 0 and got.stdout.startswith("usage: http-agent-live-bridge")


@pytest.mark.anyio
async def test_a_keeper_started_compiled_launches_through_the_compiled_launcher_next_to_it(compiled) -> None:
    bin_dir, _ = compiled
    paths = KeeperPaths.in_run_dir(str(bin_dir.parent / "run"))
    keeper = bin_dir / "ca-keeper"
    argv = run_prefix(paths, member="m1", keeper=python(keeper)) + ["--pidfile", paths.cli_pidfile, "--",
                                                                   *fake_cli_argv()]
    try:
        with anyio.fail_after(30):
            proc = await open_client(argv)
            try:
                ch = await KeeperChannel.open(ProcessBytes(proc), timeout_s=20)
                assert json.loads(await ch.receive()) == {"ready": ch.hello.pid}
                assert int(Path(paths.cli_pidfile).read_text()) == ch.hello.pid  # written by ca-launch's code
                await ch.send(b'{"op":"echo","n":1}')
                assert await ch.receive() == b'{"op":"echo","n":1}'
                cmdline = Path(f"/proc/{ch.hello.keeper_pid}/cmdline").read_bytes().split(b"\0")
                assert str(keeper).encode() in cmdline  # the compiled keeper, not the committed script
            finally:
                await reap(proc)
    finally:
        subprocess.run(retire_argv(paths, grace_s=1.0), check=False, timeout=30)


def test_a_helper_that_does_not_compile_fails_the_build_and_is_left_as_it_was(tmp_path) -> None:
    bin_dir, lib_dir = tmp_path / "bin", tmp_path / "lib"
    bin_dir.mkdir()
    (bin_dir / "broken").write_text("#!/usr/bin/python3 -IS\ndef f(:\n")
    (bin_dir / "shell").write_text("#!/bin/sh\necho hi\n")
    done = run_compiler(bin_dir, lib_dir, "broken")
    assert done.returncode == 1 and "SyntaxError" in done.stderr
    assert (bin_dir / "broken").read_text() == "#!/usr/bin/python3 -IS\ndef f(:\n" and not lib_dir.exists()
    done = run_compiler(bin_dir, lib_dir, "shell")
    assert done.returncode == 1 and done.stderr.strip() == f"{bin_dir / 'shell'}: not a python3 script (first line '#!/bin/sh')"
    assert run_compiler(bin_dir, lib_dir).returncode == 2  # no helper named: usage


def test_the_compiler_is_an_input_of_the_image_tag(tmp_path, monkeypatch) -> None:
    before = image_tag()
    copy = tmp_path / "compile_helpers.py"
    copy.write_bytes(COMPILE_HELPERS.read_bytes() + b"\n# changed\n")
    monkeypatch.setattr("images.identity.COMPILE_HELPERS", copy)
    assert image_tag() != before
