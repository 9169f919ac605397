"""TraceML 0.5.0's MONAI names, so that its scripts run here unchanged.

This project has no MONAI adapter: ``init()`` starts TraceML (``mode="auto"``: the
forward, backward and optimizer hooks, the DataLoader wait) and ``TraceMLHandler``
attaches nothing. Each says so once, in one ``traceml:`` warning; training goes on.
A ``SupervisedTrainer``'s iterations are not numbered as steps: wrap your own loop
in ``traceml.trace_step`` for step lines (docs/compat-0.5.md).
"""

from __future__ import annotations

import importlib.util
from typing import Any

from traceml_ai.rank import TraceMLInitConfig, warn_once

IS_MONAI_AVAILABLE = importlib.util.find_spec("monai") is not None
"""Whether MONAI is installed (0.5.0's name)."""

_NOTICE = (
    "traceml: the MONAI integration of TraceML 0.5.0 is not in this release: "
    "SupervisedTrainer steps are not traced (use traceml.trace_step in your loop)"
)


def init() -> TraceMLInitConfig:
    """Start TraceML as ``traceml.init()`` does, with one notice."""
    import traceml_ai as traceml

    warn_once("monai", _NOTICE)
    return traceml.init(mode="auto")


class TraceMLHandler:
    """0.5.0's MONAI handler: accepted in ``train_handlers``, attaches nothing."""

    def attach(self, engine: Any) -> None:
        """Called by MONAI for each engine the handler is listed on."""
        del engine
        warn_once("monai", _NOTICE)
