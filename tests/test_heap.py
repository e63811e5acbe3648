"""common.daemon.heap: the startup heap frozen out of every later collection, long collections logged."""

from __future__ import annotations

import gc

import structlog

from common.daemon import heap


def test_freezing_moves_every_live_object_out_of_the_collected_generations():
    kept = [object() for _ in range(1000)]  # noqa: F841  # alive now: must end up frozen
    gc.unfreeze()
    try:
        frozen = heap.freeze_startup_heap()
        assert frozen == gc.get_freeze_count() > 1000
        assert gc.get_count()[0] < 50  # the collection ran and emptied generation 0
        assert sum(len(gc.get_objects(g)) for g in range(3)) < frozen  # the rest are frozen
    finally:
        gc.unfreeze()


def test_a_collection_at_least_as_long_as_the_bound_is_logged_until_closed():
    watch = heap.watch_pauses(min_ms=0.0)  # every collection qualifies
    try:
        with structlog.testing.capture_logs() as logs:
            gc.collect()
        pauses = [e for e in logs if e["event"] == "gc_pause"]
        assert pauses and pauses[-1]["generation"] == 2 and pauses[-1]["ms"] >= 0
        assert watch.longest_ms > 0
    finally:
        watch.close()
    watch.close()  # idempotent
    assert watch not in gc.callbacks
    with structlog.testing.capture_logs() as logs:
        gc.collect()
    assert not [e for e in logs if e["event"] == "gc_pause"]


def test_a_collection_shorter_than_the_bound_is_not_logged():
    watch = heap.watch_pauses(min_ms=60_000.0)
    try:
        with structlog.testing.capture_logs() as logs:
            gc.collect(0)
        assert not [e for e in logs if e["event"] == "gc_pause"]
        assert 0 < watch.longest_ms < 60_000.0
    finally:
        watch.close()
