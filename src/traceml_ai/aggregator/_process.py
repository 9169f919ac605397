"""Settings for a process whose job is to be the aggregator.

``traceml run``'s aggregator process, ``traceml serve`` and the Ray aggregator actor
call :func:`tune_gc_for_aggregator` once; a library user embedding an
:class:`Aggregator` in their own process keeps their own GC settings.
"""

from __future__ import annotations

import gc

AGGREGATOR_GC_GEN0_THRESHOLD = 10_000
"""Allocations between two young-generation collections in an aggregator process."""


def tune_gc_for_aggregator() -> None:
    """Raise the young-generation GC threshold to :data:`AGGREGATOR_GC_GEN0_THRESHOLD`.

    Parsing one 100-item step_time batch allocates about 1,200 dicts, all freed by
    reference counting a moment later, none in a cycle. With CPython's default
    threshold (700) every batch triggers a collection mid-parse that walks the live
    parse tree for nothing (about a tenth of the export worker's time, measured in
    bench/export.py); with 10,000 a batch is parsed and gone between two
    collections. Cyclic garbage is still collected, a few thousand allocations
    later. A higher threshold already set (or GC turned off) is left alone.
    """
    gen0, gen1, gen2 = gc.get_threshold()
    if 0 < gen0 < AGGREGATOR_GC_GEN0_THRESHOLD:
        gc.set_threshold(AGGREGATOR_GC_GEN0_THRESHOLD, gen1, gen2)
