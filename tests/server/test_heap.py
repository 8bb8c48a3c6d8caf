"""The start-up heap is frozen out of the garbage collector's walks (server/runtime/heap.py)."""

from __future__ import annotations

import gc

from protoserve.server.runtime.heap import freeze_startup_heap


def test_a_full_collection_after_the_freeze_walks_none_of_what_start_up_left() -> None:
    startup = [[i] for i in range(20_000)]  # long-lived objects, as a loaded model leaves
    try:
        frozen = freeze_startup_heap()
        walked = gc.get_objects()  # what a full collection now walks
        assert frozen >= len(startup)
        assert len(walked) < 1_000
        assert not any(item is startup for item in walked)
    finally:
        gc.unfreeze()
    assert any(item is startup for item in gc.get_objects())
