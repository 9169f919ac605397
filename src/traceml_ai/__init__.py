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

from importlib import metadata as _metadata

from traceml_ai.rank._sdk import (
    TraceMLInitConfig,
    TraceMLWarning,
    final_summary,
    init,
    shutdown,
    start,
    summary,
    trace_phase,
    trace_step,
)
from traceml_ai.rank._wrappers import (
    wrap_backward,
    wrap_dataloader_fetch,
    wrap_forward,
    wrap_h2d,
    wrap_optimizer,
)
from traceml_ai.rank.sink import ItemSink

try:
    __version__: str = _metadata.version("traceml-ai")
except _metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "ItemSink",
    "TraceMLInitConfig",
    "TraceMLWarning",
    "__version__",
    "final_summary",
    "init",
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
