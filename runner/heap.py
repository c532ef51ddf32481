"""What a long-running service does with its start-up's objects: freezes them (issue 16).

A full collection of the cyclic garbage collector walks every object it tracks, with the event
loop stopped: every turn in flight and every request waits. Most of a service's objects are its
start-up's (modules, classes, functions, pydantic's schemas and validators): 42 000 in the
daemon once ready, 75 000 after a minute of turns (lazy imports), none of which ever becomes
garbage. Measured in ``tests/bench/soak.py`` (2026-12-06): the daemon's full collections took
70-90 ms each, about once a minute under load; the proxy service's 30-55 ms, twice a minute.

:func:`freeze_startup` moves what exists when the service is ready into the collector's
permanent generation, which no collection walks. Reference counting still frees those
objects as ever; only a reference cycle among them would never be collected. Process entry
points only (``cloud-agent serve``, the proxy service): a test process that runs a daemon
in-process would freeze its other tests' objects too.
"""

from __future__ import annotations

import gc


def freeze_startup() -> int:
    """Collect once (start-up's own garbage is not kept), then freeze; returns the number of
    objects the collector no longer walks."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
