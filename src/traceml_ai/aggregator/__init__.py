"""The aggregator: one per run, whatever the number of ranks and nodes.

``protocol`` is what the launcher and the aggregator process tell each other; the
rest (the service, its runner) loads on first use, so that the launcher can speak the
protocol without importing the transport server and the exporter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from traceml_ai._lazy_names import lazy_surface

if TYPE_CHECKING:  # the names of _LAZY, for mypy and editors (tests/traceml_ai/test_surfaces.py)
    from traceml_ai.aggregator._process import tune_gc_for_aggregator as tune_gc_for_aggregator
    from traceml_ai.aggregator._runner import install_stop_handlers as install_stop_handlers
    from traceml_ai.aggregator._runner import run_until_done as run_until_done
    from traceml_ai.aggregator._service import Aggregator as Aggregator
    from traceml_ai.aggregator._service import AggregatorConfig as AggregatorConfig
    from traceml_ai.aggregator._service import FinalizeResult as FinalizeResult

_LAZY = {
    "traceml_ai.aggregator._process": ("tune_gc_for_aggregator",),
    "traceml_ai.aggregator._runner": ("install_stop_handlers", "run_until_done"),
    "traceml_ai.aggregator._service": ("Aggregator", "AggregatorConfig", "FinalizeResult"),
}

__all__, __getattr__, __dir__ = lazy_surface(__name__, _LAZY, globals())
