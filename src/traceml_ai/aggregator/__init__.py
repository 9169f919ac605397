"""The aggregator: one per run, whatever the number of ranks and nodes.

``protocol`` is what the launcher and the aggregator process tell each other; the
rest (the service, its runner) loads on first use, so that the launcher can speak the
protocol without importing the transport server and the exporter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from traceml_ai._lazy_names import lazy_getattr

if TYPE_CHECKING:
    from traceml_ai.aggregator._process import tune_gc_for_aggregator
    from traceml_ai.aggregator._runner import install_stop_handlers, run_until_done
    from traceml_ai.aggregator._service import (
        Aggregator,
        AggregatorConfig,
        FinalizeResult,
    )

_LAZY = {
    "tune_gc_for_aggregator": "traceml_ai.aggregator._process",
    "install_stop_handlers": "traceml_ai.aggregator._runner",
    "run_until_done": "traceml_ai.aggregator._runner",
    "Aggregator": "traceml_ai.aggregator._service",
    "AggregatorConfig": "traceml_ai.aggregator._service",
    "FinalizeResult": "traceml_ai.aggregator._service",
}


__getattr__ = lazy_getattr(__name__, _LAZY, globals())


__all__ = [
    "Aggregator",
    "AggregatorConfig",
    "FinalizeResult",
    "install_stop_handlers",
    "run_until_done",
    "tune_gc_for_aggregator",
]
