"""settle_heap: start-up's objects leave the collector's reach, and cycles made afterwards are still collected."""

import gc
import weakref

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
