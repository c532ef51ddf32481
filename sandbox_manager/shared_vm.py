"""Whether two processes share one address space: kcmp(2) with KCMP_VM, from the host.

A child made with ``vfork`` or ``clone(CLONE_VM)`` — glibc's ``posix_spawn``, libuv's
spawn in Node, Bun's — runs in its parent's address space until it execs. For that moment
``/proc`` shows it with its parent's name and its parent's ``VmRSS`` and ``VmHWM`` to the
byte (they are the address space's), so a sum over the processes of a CLI's tree counts
the CLI twice: a Kilo turn's tool spawn read as 2 × 579 MiB (measured by the CI load
test's sampler, stop 39). Only the kernel can tell such a child from a real copy.

kcmp needs the caller to be allowed to ptrace-read both processes (the daemon reads its
sandboxes from the host as root). Where it is not available the answer is False: the
process is counted, which over-counts and never under-counts.
"""

from __future__ import annotations

import ctypes
import platform

_SYS_KCMP = {"x86_64": 312, "aarch64": 272}.get(platform.machine())
_KCMP_VM = 1

try:
    _syscall = ctypes.CDLL(None, use_errno=True).syscall
except (OSError, AttributeError):  # no libc to call through
    _syscall = None


def same_vm(pid_a: int, pid_b: int) -> bool:
    """The two host pids share one address space now (False if unknown or either is gone)."""
    if _SYS_KCMP is None or _syscall is None:
        return False
    return int(_syscall(ctypes.c_long(_SYS_KCMP), ctypes.c_long(pid_a), ctypes.c_long(pid_b),
                        ctypes.c_long(_KCMP_VM), ctypes.c_long(0), ctypes.c_long(0))) == 0
