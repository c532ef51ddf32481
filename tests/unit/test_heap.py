"""runner.heap: a service's start-up objects leave the collector's walks (issue 16)."""

from __future__ import annotations

import gc
import weakref

from runner import heap


class Cycle:
    def __init__(self) -> None:
        self.me = self


def cycles() -> int:
    return sum(isinstance(o, Cycle) for o in gc.get_objects())


def test_freeze_startup_collects_start_up_garbage_then_freezes_what_is_alive() -> None:
    assert gc.get_freeze_count() == 0  # this test process never froze anything
    dead = weakref.ref(Cycle())  # start-up's garbage: a cycle no one refers to, only the collector frees
    kept = Cycle()
    assert dead() is not None and cycles() == 2
    thresholds = gc.get_threshold()
    assert thresholds == (700, 10, 10)  # CPython's
    try:
        frozen = heap.freeze_startup()
        assert gc.get_threshold() == (20_000, 20, 20)
        assert frozen == gc.get_freeze_count() and frozen > 10_000
        assert dead() is None  # collected first, not frozen
        assert cycles() == 0  # the live cycle is frozen: no collection walks it
        gc.collect()
        assert kept.me is kept and cycles() == 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
    assert gc.get_freeze_count() == 0 and cycles() == 1  # walked again once unfrozen
