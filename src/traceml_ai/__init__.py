"""TraceML: live telemetry from every rank of a PyTorch run.

Typical use in a training script launched with ``traceml run``::

    import traceml_ai as traceml

    traceml.init()
    for batch in loader:
        with traceml.trace_step(model):
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()

The public names of TraceML 0.5.0 are here with the same signatures
(docs/compat-0.5.md). Importing this package never imports torch; the CLI and the
aggregator import it too.
"""

from __future__ import annotations

# Nothing is imported at module level (typing neither): the console script imports
# this package before the CLI's Ctrl-C handler is in place.
from traceml_ai._lazy_names import lazy_getattr

TYPE_CHECKING = False
if TYPE_CHECKING:
    from traceml_ai.rank import (
        ItemSink,
        TraceMLInitConfig,
        TraceMLWarning,
        final_summary,
        init,
        record_tokens,
        shutdown,
        start,
        summary,
        trace_phase,
        trace_step,
        wrap_backward,
        wrap_dataloader_fetch,
        wrap_forward,
        wrap_h2d,
        wrap_optimizer,
    )

    __version__: str

# Each public name loads on first use from the rank's surface (``traceml_ai.rank``,
# itself lazy), so that `traceml` (the CLI, the aggregator) starts without the rank
# SDK: quick to start, and a Ctrl-C during that start meets the CLI's handler, not an
# import in progress.
_LAZY = dict.fromkeys(
    (
        "ItemSink",
        "TraceMLInitConfig",
        "TraceMLWarning",
        "final_summary",
        "init",
        "record_tokens",
        "shutdown",
        "start",
        "summary",
        "trace_phase",
        "trace_step",
        "wrap_backward",
        "wrap_dataloader_fetch",
        "wrap_forward",
        "wrap_h2d",
        "wrap_optimizer",
    ),
    "traceml_ai.rank",
)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("traceml-ai")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "0.0.0+unknown"


__getattr__ = lazy_getattr(__name__, _LAZY, globals(), {"__version__": _version})


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "ItemSink",
    "TraceMLInitConfig",
    "TraceMLWarning",
    "__version__",
    "final_summary",
    "init",
    "record_tokens",
    "shutdown",
    "start",
    "summary",
    "trace_phase",
    "trace_step",
    "wrap_backward",
    "wrap_dataloader_fetch",
    "wrap_forward",
    "wrap_h2d",
    "wrap_optimizer",
]
