"""What a driver asks for to start its CLI: command line, environment, config files, prechecks.

A :class:`LaunchSpec` is plain data. Whoever owns the place the CLI runs (a local
subprocess in tests, the sandbox manager's ``docker exec`` in production) materialises it:
writes ``files``, then starts ``launcher_argv()`` and sends ``secret_header_line()`` as the
first stdin line. Secrets therefore never appear on a command line, in container config,
in labels or in files, and ``repr()`` of a spec never shows them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr

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
    model_config = ConfigDict(frozen=True)

    runtime: str
    argv: list[str]
    cwd: str
    env: dict[str, str] = Field(default_factory=dict)
    secret_env: dict[str, SecretStr] = Field(default_factory=dict)
    files: list[FileSpec] = Field(default_factory=list)
    dirs: list[str] = Field(default_factory=list)
    # Prechecks run by the launcher before the CLI starts; a failure prints one JSON line
    # {"type":"launch_error",...} and exits 3, so a driver sees it on the same stream.
    require_files: list[str] = Field(default_factory=list)
    require_header: HeaderCheck | None = None
    inherit_env: bool = False  # local processes only: start from the parent environment

    def launcher_argv(self, *, pidfile: str, launcher: Sequence[str] = (IN_SANDBOX_LAUNCHER,)) -> list[str]:
        argv = [*launcher, "--pidfile", pidfile, "--cwd", self.cwd]
        if self.secret_env:
            argv.append("--secret-header")
        for path in self.require_files:
            argv += ["--require-file", path]
        if self.require_header is not None:
            h = self.require_header
            argv += ["--require-header", h.path, h.key, h.value]
        return argv + ["--", *self.argv]

    def secret_header_line(self) -> bytes | None:
        if not self.secret_env:
            return None
        return json.dumps({k: v.get_secret_value() for k, v in self.secret_env.items()}).encode()

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
