"""Starting a driver's launch inside a retained sandbox (the glue between drivers and
sandbox_manager, which never import each other)."""

from __future__ import annotations

from drivers.base import Launch
from drivers.models import MemberPaths
from sandbox_manager.engine import FileEntry
from sandbox_manager.launch_files import encode as encode_files
from sandbox_manager.member_processes import MemberDirs, MemberProcess
from sandbox_manager.sandbox import Sandbox
from sandbox_manager.sandboxes import SandboxManager


def member_paths(dirs: MemberDirs) -> MemberPaths:
    return MemberPaths(home=dirs.home, workspace=dirs.workspace, run_dir=dirs.run_dir)


def launch_files(launch: Launch, dirs: list[str]) -> bytes:
    """The launch's files and directories (``dirs`` besides the spec's), as its exec's first
    stdin bytes: the launcher writes them in the sandbox (sandbox_manager.launch_files)."""
    spec = launch.spec
    files = [FileEntry(f.path, f.content.encode(), f.mode) for f in spec.files if f.overwrite]
    keep = [FileEntry(f.path, f.content.encode(), f.mode) for f in spec.files if not f.overwrite]
    return encode_files(files, keep, [*spec.dirs, *dirs])


async def start_in_sandbox(manager: SandboxManager, sandbox: Sandbox, dirs: MemberDirs, launch: Launch,
                           *, name: str = "cli") -> MemberProcess:
    spec = launch.spec
    files = launch_files(launch, [dirs.run_dir, dirs.home, dirs.workspace])
    pidfile = f"{dirs.run_dir}/{name}.pid"
    argv = spec.launcher_argv(pidfile=pidfile, await_listen=manager.model_endpoint, files_on_stdin=True)
    # The exec starts in the agent's home (always present); the launcher chdirs to spec.cwd.
    return await manager.launch(sandbox, argv=argv, env=dict(spec.env), workdir="/home/agent", pidfile=pidfile,
                                files=files)
