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
from traceml_ai._lazy_names import lazy_surface

TYPE_CHECKING = False
if TYPE_CHECKING:  # the names of _LAZY, for mypy and editors (tests/traceml_ai/test_surfaces.py)
    from traceml_ai.rank import ItemSink as ItemSink
    from traceml_ai.rank import TraceMLInitConfig as TraceMLInitConfig
    from traceml_ai.rank import TraceMLWarning as TraceMLWarning
    from traceml_ai.rank import final_summary as final_summary
    from traceml_ai.rank import init as init
    from traceml_ai.rank import record_tokens as record_tokens
    from traceml_ai.rank import shutdown as shutdown
    from traceml_ai.rank import start as start
    from traceml_ai.rank import summary as summary
    from traceml_ai.rank import trace_phase as trace_phase
    from traceml_ai.rank import trace_step as trace_step
    from traceml_ai.rank import wrap_backward as wrap_backward
    from traceml_ai.rank import wrap_dataloader_fetch as wrap_dataloader_fetch
    from traceml_ai.rank import wrap_forward as wrap_forward
    from traceml_ai.rank import wrap_h2d as wrap_h2d
    from traceml_ai.rank import wrap_optimizer as wrap_optimizer

    __version__: str

# The surface, declared once. Each public name loads on first use from the rank's
# surface (``traceml_ai.rank``, itself lazy), so that `traceml` (the CLI, the
# aggregator) starts without the rank SDK: quick to start, and a Ctrl-C during that
# start meets the CLI's handler, not an import in progress.
_LAZY = {
    "traceml_ai.rank": (
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
}


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("traceml-ai")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "0.0.0+unknown"


__all__, __getattr__, __dir__ = lazy_surface(
    __name__, _LAZY, globals(), computed={"__version__": _version}
)
