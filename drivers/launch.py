"""What a driver asks for to start its CLI: command line, environment, config files, prechecks.

A :class:`LaunchSpec` is plain data. Whoever owns the place the CLI runs (a local
subprocess in tests, the sandbox manager's ``docker exec`` in production) materialises it:
writes ``files``, then starts ``launcher_argv()``. A spec holds no secret: the gateway key
never enters a sandbox (SPEC 7) — each CLI is configured with the sandbox's placeholder key,
which the host's model proxy replaces on the way out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

IN_SANDBOX_LAUNCHER = "ca-launch"


class FileSpec(BaseModel):
    """A config file the CLI needs before it starts. Never holds a secret."""

    model_config = ConfigDict(frozen=True)

    path: str
    content: str
    mode: int = 0o644
    overwrite: bool = True  # False: keep a file the CLI may have edited (e.g. Codex trust entries)


class HeaderCheck(BaseModel):
    """Precheck: the first line of ``path`` is a JSON object whose ``key`` equals ``value``."""

    model_config = ConfigDict(frozen=True)

    path: str
    key: str
    value: str


class LaunchSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    runtime: str
    argv: list[str]
    cwd: str
    env: dict[str, str] = Field(default_factory=dict)
    files: list[FileSpec] = Field(default_factory=list)
    dirs: list[str] = Field(default_factory=list)
    # Prechecks run by the launcher before the CLI starts; a failure prints one JSON line
    # {"type":"launch_error",...} and exits 3, so a driver sees it on the same stream.
    require_files: list[str] = Field(default_factory=list)
    require_header: HeaderCheck | None = None
    inherit_env: bool = False  # local processes only: start from the parent environment

    def launcher_argv(self, *, pidfile: str, launcher: Sequence[str] = (IN_SANDBOX_LAUNCHER,),
                      await_listen: tuple[str, float] | None = None, files_on_stdin: bool = False) -> list[str]:
        """``await_listen`` (HOST:PORT, seconds): the CLI starts only once its model endpoint
        listens (the launcher's ``model_gate_not_listening`` after the seconds).
        ``files_on_stdin``: the launcher writes the launch's files, sent first on its stdin."""
        argv = [*launcher, "--pidfile", pidfile, "--cwd", self.cwd]
        if files_on_stdin:
            argv.append("--files-on-stdin")
        if await_listen is not None:
            argv += ["--await-listen", await_listen[0], f"{await_listen[1]:g}"]
        for path in self.require_files:
            argv += ["--require-file", path]
        if self.require_header is not None:
            h = self.require_header
            argv += ["--require-header", h.path, h.key, h.value]
        return argv + ["--", *self.argv]

    def materialize_files_locally(self) -> None:
        """Write dirs and files on this machine (local-process transport)."""
        for d in self.dirs:
            Path(d).mkdir(parents=True, exist_ok=True)
        for f in self.files:
            p = Path(f.path)
            if p.exists() and not f.overwrite:
                continue
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(p.name + ".tmp")
            tmp.write_text(f.content)
            os.chmod(tmp, f.mode)
            tmp.replace(p)
