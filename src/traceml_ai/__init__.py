"""TraceML: live telemetry from every rank of a PyTorch run.

Typical use in a training script launched with ``traceml run``::

    import traceml_ai as traceml

    traceml.init()
    for batch in loader:
        with traceml.trace_step(model):
            loss = model(batch).sum()
            loss.backward()
            optimizer.step()

Importing this package never imports torch; the CLI and the aggregator import it too.
"""

from traceml_ai.rank._sdk import TraceMLWarning, init, shutdown, trace_phase, trace_step
from traceml_ai.rank.sink import ItemSink

__all__ = ["ItemSink", "TraceMLWarning", "init", "shutdown", "trace_phase", "trace_step"]
