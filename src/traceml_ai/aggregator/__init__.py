"""The aggregator: one per run, whatever the number of ranks and nodes."""

from traceml_ai.aggregator._process import tune_gc_for_aggregator
from traceml_ai.aggregator._runner import install_stop_handlers, run_until_done
from traceml_ai.aggregator._service import (
    DEFAULT_FINALIZE_TIMEOUT_S,
    Aggregator,
    AggregatorConfig,
    FinalizeResult,
)

__all__ = [
    "DEFAULT_FINALIZE_TIMEOUT_S",
    "Aggregator",
    "AggregatorConfig",
    "FinalizeResult",
    "install_stop_handlers",
    "run_until_done",
    "tune_gc_for_aggregator",
]
