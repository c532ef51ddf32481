"""A launch's config files, delivered on its exec's stdin and written inside the sandbox.

A launch used to write them with the engine's archive API before its exec: ~46 ms an archive
on this machine (the engine mounts the container's file systems and re-execs itself to
extract), a second engine call on every NEW and RESTORED turn, and its writes ran as root
through paths the sandbox controls. Now the launch's own exec carries them: these bytes come
first on its stdin, and ``ca-launch --files-on-stdin`` (or ``ca-keeper run --files-on-stdin``)
writes them as the sandbox's own user before anything else, then the rest of stdin is the
CLI's. Files hold no secret (drivers.launch.FileSpec).

Encoding: ``CA-FILES <size>\\n`` then ``size`` bytes of records, each ``KIND MODE SIZE PATH\\n``
followed by SIZE bytes of content; KIND ``D`` a directory (made with its parents), ``F`` a file
(rewritten, whole or not at all), ``K`` a file written only when absent.
"""

from __future__ import annotations

from sandbox_manager.engine import FileEntry

MAGIC = b"CA-FILES"


def _record(kind: bytes, mode: int, path: str, content: bytes = b"") -> bytes:
    raw = path.encode()
    if not path.startswith("/") or b"\n" in raw or b"\0" in raw:
        raise ValueError(f"a launch file's path must be absolute, on one line and without NUL: {path!r}")
    return b"%s %o %d %s\n" % (kind, mode, len(content), raw) + content


def encode(files: list[FileEntry], keep: list[FileEntry], dirs: list[str]) -> bytes:
    """The bytes a launch sends first: ``dirs``, then ``files`` (rewritten), then ``keep``
    (written only where nothing is yet)."""
    body = b"".join([*(_record(b"D", 0o755, d) for d in dirs),
                     *(_record(b"F", f.mode, f.path, f.content) for f in files),
                     *(_record(b"K", f.mode, f.path, f.content) for f in keep)])
    return b"%s %d\n" % (MAGIC, len(body)) + body
