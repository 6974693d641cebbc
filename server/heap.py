"""The collector's settings for a serving process, applied once its server is built.

A request allocates thousands of short-lived objects that reference counting frees, yet they keep tripping the
default generation-0 threshold (700): ~25 young collections per 1,000 requests. Every hundredth or so is a full
collection, which also walks everything start-up left behind (modules, protobuf descriptors, tables): 30-40 ms, a
stall of every request in flight. Measured in bench.handler (40,000 requests), the collector's share of the CPU:
3.7 % -> 0.2 %, and 9-10 full collections -> 0-1.
"""

from __future__ import annotations

import gc
import sys

# Ten times the default: cycles still go, a few thousand objects later.
YOUNG_THRESHOLD = 7_000


def settle_heap() -> None:
    """Collect what start-up left, move the survivors out of the collector's reach for good (`gc.freeze`: nearly
    all live as long as the process; reference counting still frees the others, and only a cycle among them would
    stay), and collect the young generation less often.

    Called in the running event loop, it also stops the loop from recording every async generator it meets (the
    `firstiter` hook): a streamed answer passes through ~17 of them, and the loop kept a weak reference to each in a
    set read only by `shutdown_asyncgens` when the loop closes, after a drain has ended every stream. That set cost
    an open stream ~2.6 KB and each generator its Python-level add and remove. The `finalizer` hook stays: a
    generator dropped unfinished is still closed by the loop."""
    sys.set_asyncgen_hooks(firstiter=None)
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, middle, old)
