"""The run summary (``traceml_ai.run_summary``; not ``traceml_ai.summary``, which is
the 0.5.0 function ``traceml.summary()``): read a run's export files and say what happened.

One engine behind ``traceml summary`` (text, ``--json``, ``--short``, ``--follow``,
``--plot``), ``traceml.summary()`` and the short form at the end of ``traceml run``:

- ``_read``: the one reader of the export files (every size; damaged input reported);
- ``_phases``: a step line's events as a row of phase times, and the phase breakdown;
- ``_straggler``: the straggler analysis (docs/reading-the-files.md gives the rule);
- ``_report``: the summary dict (:func:`summarize_run`) and its text
  (:func:`format_summary`);
- ``live``: the ``--follow`` terminal view; ``plot``: the ``--plot`` figure.

Light to import: orjson only (never torch, never pyarrow).
"""

from traceml_ai.run_summary._phases import BUILT_IN_PHASES
from traceml_ai.run_summary._report import (
    STREAM_FILES,
    WARNING_FILE,
    SummaryError,
    format_summary,
    step_series,
    straggler_line,
    straggler_view,
    summarize_run,
)
from traceml_ai.run_summary._straggler import (
    SlowNode,
    Straggler,
    StragglerView,
    Waiting,
    analyze,
)

__all__ = [
    "BUILT_IN_PHASES",
    "STREAM_FILES",
    "WARNING_FILE",
    "SlowNode",
    "Straggler",
    "StragglerView",
    "SummaryError",
    "Waiting",
    "analyze",
    "format_summary",
    "step_series",
    "straggler_line",
    "straggler_view",
    "summarize_run",
]
