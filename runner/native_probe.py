"""Is a member's native session state there right now? (the inspector's third step)

An operator command may afford one exec in the chat's sandbox: it lists the member's
native session files exactly where its driver says the CLI keeps them, and counts the
member's home. It never starts a stopped sandbox and never looks into a sandbox whose
identity the supervisor has condemned (LOST): its files are not this chat's evidence.
"""

from __future__ import annotations

import anyio
from pydantic import BaseModel, Field

from drivers.models import Locator
from drivers.registry import RUNTIMES, get_driver
from runner.processes import member_paths
from sandbox_manager.engine import Engine, NotFound
from state.records import MemberRecord, SandboxRecord, SandboxState
from sandbox_manager.sandboxes import SandboxManager

PROBE_TIMEOUT_S = 15.0

# The exec's script: "$1" is the member's home; every further argument is one glob pattern
# naming session files (the driver's Driver.native_state), expanded here, in the sandbox.
_SCRIPT = r"""
home="$1"; shift
n=$(find "$home" -type f 2>/dev/null | wc -l)
b=$(du -sb "$home" 2>/dev/null | cut -f1)
echo "home ${n:-0} ${b:-0}"
IFS='
'
for word in "$@"; do for f in $word; do [ -f "$f" ] && stat -c 'file %s %n' "$f"; done; done
exit 0
"""


class NativeFile(BaseModel):
    path: str
    size: int


class NativeState(BaseModel):
    """What one exec saw now (not at the time of the diagnosed turn)."""

    checked: bool = Field(description="false: the sandbox was not looked into (see why)")
    why: str | None = None
    present: bool | None = Field(default=None, description="the member's session files exist")
    files: list[NativeFile] = Field(default_factory=list)
    home_files: int | None = None
    home_bytes: int | None = None


def session_words(runtime: str, member: MemberRecord) -> list[str]:
    """Glob patterns of the member's native session state, as its driver keeps it."""
    if member.locator is None or runtime not in RUNTIMES:
        return []
    paths = member_paths(SandboxManager.member_dirs(member.home_member_id))
    return get_driver(runtime).native_state(paths, Locator(id=member.locator.id, path=member.locator.path))


def parse_listing(out: str) -> tuple[int | None, int | None, list[NativeFile]]:
    home_files = home_bytes = None
    files: list[NativeFile] = []
    for line in out.splitlines():
        parts = line.split(" ", 2)
        if parts[0] == "home" and len(parts) == 3 and parts[1].isdigit() and parts[2].isdigit():
            home_files, home_bytes = int(parts[1]), int(parts[2])
        elif parts[0] == "file" and len(parts) == 3 and parts[1].isdigit():
            files.append(NativeFile(path=parts[2], size=int(parts[1])))
    return home_files, home_bytes, files


async def probe_native_state(engine: Engine, sandbox: SandboxRecord | None,
                             member: MemberRecord | None) -> NativeState:
    if member is None:
        return NativeState(checked=False, why="no member record")
    if sandbox is None:
        return NativeState(checked=False, why="no sandbox recorded for the chat")
    if sandbox.state == SandboxState.LOST:
        return NativeState(checked=False, why=f"sandbox LOST ({sandbox.lost_reason}): not looked into")
    if sandbox.state == SandboxState.STOPPED:
        return NativeState(checked=False, why="sandbox stopped: inspect does not start it")
    try:
        info = await engine.inspect(sandbox.container_id)
    except NotFound:
        return NativeState(checked=True, present=False, why="the engine has no such container")
    if not info.running:
        return NativeState(checked=False, why="container not running: inspect does not start it")
    home = SandboxManager.member_dirs(member.home_member_id).home
    words = session_words(member.runtime, member)
    with anyio.fail_after(PROBE_TIMEOUT_S):
        code, out = await engine.exec_run(sandbox.container_id, ["sh", "-c", _SCRIPT, "sh", home, *words])
    if code != 0:
        return NativeState(checked=False, why=f"the listing exec exited {code}")
    home_files, home_bytes, files = parse_listing(out.decode(errors="replace"))
    present = bool(files) if words else None
    why = None if words else "the member has no saved locator to look for"
    return NativeState(checked=True, why=why, present=present, files=files, home_files=home_files,
                       home_bytes=home_bytes)
