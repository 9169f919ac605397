"""TraceML 0.5.0's RF-DETR name, so that its scripts run here unchanged.

This project has no RF-DETR adapter: ``init()`` starts TraceML (``mode="auto"``) and
says once, in one ``traceml:`` warning, that RF-DETR's training steps are not traced
by it; training goes on (docs/compat-0.5.md).
"""

from __future__ import annotations

from traceml_ai.rank import TraceMLInitConfig, warn_once


def init() -> TraceMLInitConfig:
    """Start TraceML as ``traceml.init()`` does, with one notice."""
    import traceml_ai as traceml

    warn_once(
        "rfdetr",
        "traceml: the RF-DETR integration of TraceML 0.5.0 is not in this release: "
        "model.train() steps are not traced by it (use traceml.trace_step in your loop)",
    )
    return traceml.init(mode="auto")
