"""Reading a run back (``traceml_ai.analysis``; not ``traceml_ai.summary``, which is
the 0.5.0 function ``traceml.summary()``): the analysis core every view shares (step
rows and columns, phases, the straggler analysis, figures) and the run summary built on
it: read a run's export files and say what happened.

One engine behind ``traceml summary`` (text, ``--json``, ``--short``, ``--follow``,
``--plot``), ``traceml.summary()`` and the short form at the end of ``traceml run``:

- ``_read``: the one reader of the export files (every size; damaged input reported);
- ``_phases``: a step line's events as a row of phase times, and the phase breakdown;
- ``_straggler``: the straggler analysis (docs/reading-the-files.md gives the rule);
- ``_model``: the summary as one typed value (:class:`RunSummary`, attrs; ``to_json``
  is ``--json``), which every view reads;
- ``_summarize``: :class:`RunReader` and :func:`summarize_run` (the files to a
  :class:`RunSummary`);
- ``_figures``: each stream's figures, and the step figures of any step rows
  (:func:`step_figures`); ``_running``: the process, system and system_gpu figures,
  kept as running figures per rank, node and GPU; ``_loss``: what the files say about
  their completeness;
- ``_causes``: the causes of a job with several parallel dimensions and their cost;
- ``_text``: the text (:func:`format_summary`);
- ``follow_files``: the ``--follow`` terminal view of the files as they grow; ``plot``: the ``--plot`` figure.

Light to import: orjson only (never torch, never pyarrow).
"""

from traceml_ai.analysis._causes import Coordinates, Layout, layout_of
from traceml_ai.analysis._columns import RankColumns, StepColumns, StepRow, rank_columns_of
from traceml_ai.analysis._figures import rank_phases, step_figures, step_series
from traceml_ai.analysis._loss import WARNING_FILE
from traceml_ai.analysis._model import (
    DevicePeak,
    Environment,
    FileState,
    GpuFigures,
    LossReport,
    NodeFigures,
    PhaseFigures,
    ProcessFigures,
    RankSteps,
    RunSummary,
    StepFigures,
    StepRows,
)
from traceml_ai.analysis._phases import (
    BUILT_IN_PHASES,
    MAX_USER_PHASES,
    OTHER_PHASE,
    PHASES,
    STEP_EVENT,
    UserPhaseFold,
    add_wait,
    longest_timing,
    median,
    op_label,
    percentile,
    phase_name,
    step_row,
    wait_component,
    waits_measured,
)
from traceml_ai.analysis._straggler import (
    Cause,
    Coordinate,
    ExcessSoFar,
    Imbalance,
    Slowdown,
    SlowNode,
    SlowStage,
    Stopped,
    Straggler,
    StragglerView,
    Waiting,
    analyze,
    cost_line,
    verdict_line,
)
from traceml_ai.analysis._summarize import (
    STREAM_FILES,
    RunReader,
    SummaryError,
    export_folder_of,
    summarize_run,
)
from traceml_ai.analysis._text import format_summary

__all__ = [
    "BUILT_IN_PHASES",
    "MAX_USER_PHASES",
    "OTHER_PHASE",
    "PHASES",
    "STEP_EVENT",
    "STREAM_FILES",
    "WARNING_FILE",
    "Cause",
    "Coordinate",
    "Coordinates",
    "DevicePeak",
    "Environment",
    "ExcessSoFar",
    "FileState",
    "GpuFigures",
    "Imbalance",
    "Layout",
    "LossReport",
    "NodeFigures",
    "PhaseFigures",
    "ProcessFigures",
    "RankColumns",
    "RankSteps",
    "RunReader",
    "RunSummary",
    "SlowNode",
    "SlowStage",
    "Slowdown",
    "StepColumns",
    "StepFigures",
    "StepRow",
    "StepRows",
    "Stopped",
    "Straggler",
    "StragglerView",
    "SummaryError",
    "UserPhaseFold",
    "Waiting",
    "add_wait",
    "analyze",
    "cost_line",
    "export_folder_of",
    "format_summary",
    "layout_of",
    "longest_timing",
    "median",
    "op_label",
    "percentile",
    "phase_name",
    "rank_columns_of",
    "rank_phases",
    "step_figures",
    "step_row",
    "step_series",
    "summarize_run",
    "verdict_line",
    "wait_component",
    "waits_measured",
]
