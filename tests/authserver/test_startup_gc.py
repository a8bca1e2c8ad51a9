"""Once serving, the server leaves what start-up built out of the garbage collector's passes
(app.serve's `started` hook), and objects made later are still collected."""

from __future__ import annotations

import gc
import weakref

from authserver.app import _freeze_startup_objects


class _Node:
    def __init__(self) -> None:
        self.cycle = self


async def test_start_up_objects_are_frozen_and_later_garbage_is_still_collected() -> None:
    thresholds = gc.get_threshold()
    try:
        await _freeze_startup_objects()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold()[0] == 10_000
        later = _Node()  # a reference cycle made after start-up
        gone = weakref.ref(later)
        del later
        gc.collect()
        assert gone() is None
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
