"""A root-owned file written into a chat's new state volume from the host (SPEC 15).

The engine's archive API writes a file into a container by re-executing the engine in the
container's mount namespace: ~57 ms of a new sandbox's ~265 ms (issue 16: the identity
marker was the create path's longest step after the start). A volume of the local driver
keeps its content in a directory on this host (its ``Mountpoint``, which the disk bound
already scans), and right after the container is created, before it is started, that
directory holds the image's copy of the agent's home and nothing else: no process of the
sandbox has run, so none can have placed a link there. The file is written there directly.

Whenever the directory cannot be reached from here (a remote engine, another volume driver, a
daemon without root), :func:`put_root_file` says so and the caller uses the archive API.
"""

from __future__ import annotations

import os

from sandbox_manager.engine import AGENT_HOME


def put_root_file(mountpoint: str | None, path: str, content: bytes, mode: int = 0o444) -> bool:
    """Write ``path`` (a file directly in the agent's home, the volume's root) into the volume
    whose content is at ``mountpoint``, owned by root with ``mode``. True when written; False
    when it could not be, leaving whatever was partly written for the archive API to replace.

    Only for a container that has not been started: a sandbox process could otherwise swap
    the path under the host's write. No link is followed, at the directory or at the file."""
    name = path.removeprefix(AGENT_HOME + "/")
    if not mountpoint or name == path or "/" in name or name in ("", ".", ".."):
        return False
    try:
        home = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=home)
        try:
            os.fchown(fd, 0, 0)
            os.fchmod(fd, mode)  # the umask does not narrow it
            view = memoryview(content)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        os.close(home)
    return True
