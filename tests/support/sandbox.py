"""Looking inside a sandbox from a test (through the engine seam, as the product does)."""

from __future__ import annotations

from sandbox_manager.engine import Engine


async def processes(engine: Engine, container_id: str) -> list[dict[str, str]]:
    """ps of a sandbox: pid, pgid, stat, comm of every process."""
    _, out = await engine.exec_run(container_id, ["ps", "-eo", "pid=,pgid=,stat=,comm="])
    rows = []
    for line in out.decode(errors="replace").splitlines():
        parts = line.split(None, 3)
        if len(parts) == 4:
            rows.append(dict(zip(("pid", "pgid", "stat", "comm"), parts, strict=True)))
    return rows
