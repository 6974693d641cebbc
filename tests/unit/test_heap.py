"""settle_heap: start-up's objects leave the collector's reach, cycles made afterwards are still collected, and the
event loop keeps no record of each async generator yet still closes one dropped unfinished."""

import asyncio
import gc
import sys
import weakref

import uvloop

import pytest

from server.heap import YOUNG_THRESHOLD, settle_heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


@pytest.fixture
def restored_gc():
    threshold = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*threshold)


def test_startup_objects_are_frozen_and_young_collections_are_rarer(restored_gc):
    before = gc.get_freeze_count()
    settle_heap()
    assert gc.get_freeze_count() > before
    assert gc.get_threshold()[0] == YOUNG_THRESHOLD


def test_cycles_made_after_settling_are_still_collected_without_asking(restored_gc):
    settle_heap()
    first = None
    for _ in range(3 * YOUNG_THRESHOLD):  # garbage cycles enough to cross the young threshold several times
        a, b = _Node(), _Node()
        a.other, b.other = b, a
        first = first or weakref.ref(a)
    del a, b
    assert first() is None  # collected by the collector's own schedule, not by a gc.collect() here


def test_the_loop_keeps_no_record_of_each_async_generator_but_still_closes_a_dropped_one(restored_gc):
    closed = []

    async def answer():
        try:
            yield "first"
            yield "second"
        finally:
            closed.append(True)

    async def serve():
        settle_heap()  # as a serving process calls it, in its running loop
        events = answer()
        assert await anext(events) == "first"
        del events  # dropped unfinished, as by a caller who went away
        for _ in range(3):  # the finalizer schedules its aclose on the loop
            await asyncio.sleep(0)
        return sys.get_asyncgen_hooks()

    hooks = uvloop.run(serve())
    assert hooks.firstiter is None and hooks.finalizer is not None
    assert closed == [True]
