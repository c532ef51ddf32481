"""A CLI as a local subprocess: the transport driver tests run over (never the daemon's).

It starts the launch through the same in-sandbox launcher (``ca-launch``) the containers use,
so prechecks and the secret header behave alike; :func:`default_launcher` runs the repo's
copy of that script with the host's python3.
"""

from __future__ import annotations

import os
import signal
import tempfile
from pathlib import Path

import anyio
from anyio.abc import Process

from drivers.launch import LaunchSpec
from drivers.transport import MAX_LINE_BYTES, LineBuffer, LineTooLong, TransportClosed

REPO = Path(__file__).resolve().parents[2]
HELPERS = REPO / "images" / "sandbox" / "helpers"


class LocalProcessTransport:
    """A CLI as a local subprocess, started through the same in-sandbox launcher
    (``ca-launch``) the containers use, so prechecks and the secret header behave alike.

    stderr goes to a temp file rather than a pipe: nobody has to drain it, so a chatty
    CLI can never block on a full stderr pipe.
    """

    def __init__(self, process: Process, stderr_path: Path, pidfile: Path, *, max_line: int = MAX_LINE_BYTES) -> None:
        self._proc = process
        self._stderr_path = stderr_path
        self._pidfile = pidfile
        self._lines = LineBuffer(max_line)
        self._eof = False
        self._ended = False  # receive() has returned None
        self._broken = False  # a line overran the bound: no further framing is possible
        self._closed = False

    @classmethod
    async def start(cls, spec: LaunchSpec, *, launcher: tuple[str, ...] | None = None,
                    run_dir: Path | None = None, exec_prefix: tuple[str, ...] = (),
                    max_line: int = MAX_LINE_BYTES) -> "LocalProcessTransport":
        """Start ``spec`` as a local subprocess.

        ``exec_prefix`` runs the launcher through another local command, e.g.
        ``("docker", "exec", "-i", "-u", "agent", CONTAINER)`` with ``launcher=("ca-launch",)``:
        test harnesses use it to drive a CLI inside a container whose paths are bind-mounted
        from this machine. Environment then travels as ``-e NAME`` flags (names only).
        """
        spec.materialize_files_locally()
        run_dir = run_dir or Path(tempfile.mkdtemp(prefix="ca-run-"))
        run_dir.mkdir(parents=True, exist_ok=True)
        pidfile = run_dir / "cli.pid"
        stderr_path = run_dir / "stderr.log"
        argv = spec.launcher_argv(pidfile=str(pidfile), launcher=launcher or default_launcher())
        env = {**os.environ, **spec.env} if spec.inherit_env else dict(spec.env)
        if exec_prefix:
            env_flags = [flag for name in spec.env for flag in ("-e", name)]
            argv = [*exec_prefix[:-1], *env_flags, exec_prefix[-1], *argv]
            env = {**os.environ, **spec.env}
        stderr = open(stderr_path, "ab")  # noqa: SIM115 - handed to the child
        try:
            proc = await anyio.open_process(argv, stdin=-1, stdout=-1, stderr=stderr, env=env,
                                            start_new_session=False)
        finally:
            stderr.close()
        return cls(proc, stderr_path, pidfile, max_line=max_line)

    async def send(self, line: bytes) -> None:
        if self._closed or self._proc.stdin is None:
            raise TransportClosed("stdin already closed")
        if not line.endswith(b"\n"):
            line += b"\n"
        try:
            await self._proc.stdin.send(line)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
            raise TransportClosed(f"process stdin is gone: {exc!r}") from exc

    async def receive(self) -> bytes | None:
        while True:
            try:
                line = self._lines.pop_line()
            except LineTooLong:
                self._broken = True
                raise
            if line is not None:
                return line
            if self._eof:
                line = self._lines.rest()
                self._ended = line is None
                return line
            assert self._proc.stdout is not None
            try:
                chunk = await self._proc.stdout.receive(65536)
            except (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError):
                self._eof = True
                continue
            self._lines.feed(chunk)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._proc.stdin is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self._proc.stdin.aclose()
                except (anyio.BrokenResourceError, OSError):
                    pass

    @property
    def alive(self) -> bool:
        return not (self._ended or self._broken or self._closed) and self._proc.returncode is None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    def diagnostics(self) -> str:
        try:
            data = self._stderr_path.read_bytes()[-8192:]
        except OSError:
            return ""
        return data.decode(errors="replace")

    async def kill(self, grace_s: float = 2.0) -> None:
        """Kill the whole process group (the launcher made the CLI a group leader)."""
        await self.close()
        try:
            pgid = int(self._pidfile.read_text().strip())
        except (OSError, ValueError):
            pgid = self._proc.pid
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            with anyio.move_on_after(grace_s):
                await self._proc.wait()
            if self._proc.returncode is not None:
                break
        with anyio.CancelScope(shield=True), anyio.move_on_after(grace_s):
            await self._proc.wait()

    async def wait(self) -> int:
        return await self._proc.wait()


def default_launcher() -> tuple[str, ...]:
    """The in-image launcher script, run with the host's python3 for local processes."""
    return ("python3", str(HELPERS / "ca-launch"))
