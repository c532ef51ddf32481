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

It also makes the youngest generation's collections rarer (:data:`THRESHOLDS`). A turn makes
thousands of short-lived containers (its events, models, coroutines), so with CPython's default
(a young collection every 700 net allocations) a 16-chat run of Pi spent 0.1-0.2 ms of the
daemon's CPU a turn in the collector; with these thresholds, under 0.05
(tests/bench/bench_supervisor.py, "this process's garbage collector"). A young collection
walks only the survivors, which a larger threshold does not make more of; what waits longer
is cyclic garbage made meanwhile, bounded by the threshold.
"""

from __future__ import annotations

import gc

THRESHOLDS = (20_000, 20, 20)  # young collections, and of each older generation per younger one's


def freeze_startup() -> int:
    """Collect once (start-up's own garbage is not kept), then freeze, and collect less often
    from now on (:data:`THRESHOLDS`); returns the number of objects the collector no longer walks."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*THRESHOLDS)
    return gc.get_freeze_count()
