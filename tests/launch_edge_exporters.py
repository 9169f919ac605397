"""Slow custom exporters for the launcher edge tests (``tests/e2e/test_launch_edges.py``).

Named through the real CLI as ``tests.launch_edge_exporters:make_slow_start`` (its
factory sleeps ``SLOW_S``, so the aggregator is still starting) or
``...:make_slow_export`` (every ``export`` call sleeps ``EXPORT_S``, so batches pile
up and the drain at finalization takes until ``--finalize-timeout-sec``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from traceml_ai.export import ExportContext, InMemoryExporter

SLOW_S = 4.0
EXPORT_S = 1.0


class _SlowExporter(InMemoryExporter):
    def export(self, records: Sequence[Any]) -> None:
        time.sleep(EXPORT_S)
        super().export(records)


def make_slow_start(context: ExportContext) -> InMemoryExporter:
    """A factory that takes ``SLOW_S`` seconds: the aggregator is 'starting' meanwhile."""
    time.sleep(SLOW_S)
    return InMemoryExporter(context)


def make_slow_export(context: ExportContext) -> InMemoryExporter:
    """An exporter that takes ``EXPORT_S`` per call: finalization drains slowly."""
    return _SlowExporter(context)
