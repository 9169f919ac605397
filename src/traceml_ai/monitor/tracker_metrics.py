"""Every figure the aggregator logs to an experiment tracker, named once.

The names are stable (users build charts and alerts on them): each is declared once,
the tracker sink (``trackers.py``) builds its points with these values, and the table
of ``docs/trackers.md`` is :func:`tracker_metrics_markdown`
(``python -m traceml_ai.monitor.tracker_metrics --check`` fails when it is stale).
The run summary's figures (:data:`SUMMARY_FIELDS`) and :data:`RANKS`, which a point
shares with them, are declared in ``analysis.in_process``: one key set for the
summary each tracker run gets at the end and for ``traceml.summary()``'s flat dict,
which the rank builds without this package. Light on purpose: no tracker library, no
state.
"""

from __future__ import annotations

import sys
from pathlib import Path

from traceml_ai.analysis.in_process import RANKS, SUMMARY_FIELDS, TrackerMetric

__all__ = [
    "MAX_STAGES",
    "MEMORY_PEAK_ALLOCATED",
    "MEMORY_PEAK_RESERVED",
    "PHASE_MS",
    "RANKS",
    "RANK_STEP_TIME_MS",
    "SLOWDOWN",
    "SLOW_STAGE",
    "STAGE_STEP_TIME_MS",
    "STEP_TIME_MAX",
    "STEP_TIME_MEDIAN",
    "STEP_TIME_MIN",
    "STEP_TIME_P90",
    "STRAGGLER_EXCESS_MS",
    "STRAGGLER_RANK",
    "SUMMARY_ARTIFACT",
    "SUMMARY_FIELDS",
    "THROUGHPUT_STEPS_PER_S",
    "TRACKER_MAX_RANKS",
    "TRACKER_METRICS",
    "TrackerMetric",
    "tracker_metrics_markdown",
]

MAX_STAGES = 32
"""Pipeline stages with a figure of their own in a point."""
TRACKER_MAX_RANKS = 16
"""Ranks whose own step time is logged (the straggler analysis' ranks first, then
the lowest rank numbers): a tracker's chart stays readable and a point's size stays
bounded whatever the world size."""


STEP_TIME_MEDIAN = TrackerMetric(
    "traceml/step_time_ms/median", "ms", "Median over ranks of each rank's time of the logged step."
)
STEP_TIME_MAX = TrackerMetric(
    "traceml/step_time_ms/max", "ms", "The slowest rank's time of the logged step."
)
STEP_TIME_MIN = TrackerMetric(
    "traceml/step_time_ms/min", "ms", "The fastest rank's time of the logged step."
)
STEP_TIME_P90 = TrackerMetric(
    "traceml/step_time_ms/p90", "ms", "90th percentile over ranks of the logged step's time."
)
STAGE_STEP_TIME_MS = TrackerMetric(
    "traceml/stage/<stage>/step_time_ms",
    "ms",
    "Median over a pipeline stage's ranks of their time of the logged step, when the "
    "ranks said their place in the layout (at most 32 stages).",
)
PHASE_MS = TrackerMetric(
    "traceml/phase_ms/<phase>",
    "ms",
    "Median over ranks of the phase's time in the logged step (forward, backward, "
    "optimizer, dataloader_wait, user:NAME ...; the summary's phase names).",
)
STRAGGLER_EXCESS_MS = TrackerMetric(
    "traceml/straggler/excess_ms",
    "ms",
    "How much longer the straggler's own work takes than the other ranks' (the live "
    "straggler analysis over recent steps, as the dashboard and /metrics show it); 0 "
    "when it names none. Left out while the analysis does not apply.",
)
STRAGGLER_RANK = TrackerMetric(
    "traceml/straggler/rank",
    "rank",
    "The rank the straggler analysis names (the one with the largest excess); -1 when "
    "it names none.",
)
THROUGHPUT_STEPS_PER_S = TrackerMetric(
    "traceml/throughput/steps_per_s",
    "steps/s",
    "Median over ranks of the steps each rank finished per second since the previous "
    "logged step (wall clock, gaps between steps included).",
)
MEMORY_PEAK_ALLOCATED = TrackerMetric(
    "traceml/memory/peak_allocated_bytes",
    "bytes",
    "The highest peak allocated device memory any rank reported last.",
)
MEMORY_PEAK_RESERVED = TrackerMetric(
    "traceml/memory/peak_reserved_bytes",
    "bytes",
    "The highest peak reserved device memory any rank reported last.",
)
SLOWDOWN = TrackerMetric(
    "traceml/straggler/slowdown",
    "ratio",
    "What the cause the live analysis names costs: the step time over the step time "
    "without it (replayed); 1 when it names none.",
)
SLOW_STAGE = TrackerMetric(
    "traceml/straggler/slow_stage",
    "stage",
    "The pipeline stage the live analysis finds slow (the largest excess); -1 when none.",
)
RANK_STEP_TIME_MS = TrackerMetric(
    "traceml/rank/<rank>/step_time_ms",
    "ms",
    f"One rank's time of the logged step, for at most {TRACKER_MAX_RANKS} ranks: the "
    "ranks the straggler analysis names, then the lowest rank numbers.",
)

TRACKER_METRICS: tuple[TrackerMetric, ...] = (
    STEP_TIME_MIN,
    STEP_TIME_MEDIAN,
    STEP_TIME_P90,
    STEP_TIME_MAX,
    PHASE_MS,
    STAGE_STEP_TIME_MS,
    STRAGGLER_EXCESS_MS,
    STRAGGLER_RANK,
    SLOWDOWN,
    SLOW_STAGE,
    THROUGHPUT_STEPS_PER_S,
    MEMORY_PEAK_ALLOCATED,
    MEMORY_PEAK_RESERVED,
    RANKS,
    RANK_STEP_TIME_MS,
)
"""Every logged figure, in the docs' order."""


SUMMARY_ARTIFACT = "traceml_summary.json"
"""The file name of the summary JSON (``traceml summary --json``) given to each run."""


def _table(metrics: tuple[TrackerMetric, ...]) -> list[str]:
    rows = ["| Name | Unit | What it is |", "|---|---|---|"]
    rows.extend(f"| `{m.name}` | {m.unit} | {m.help} |" for m in metrics)
    return rows


def tracker_metrics_markdown() -> str:
    """The metric tables of ``docs/trackers.md``: the points, then the summary."""
    rows = [
        *_table(TRACKER_METRICS),
        "",
        "At the end of the run, once the export files are closed, each run also gets the "
        "run summary's figures (as W&B summary fields, MLflow tags, a TensorBoard text "
        f"entry) and the summary JSON as `{SUMMARY_ARTIFACT}`. `traceml.summary()` names "
        "its figures the same way (0.5.0's `traceml/step_time/...` keys among them), "
        "with `traceml/complete`:",
        "",
        *_table(SUMMARY_FIELDS),
    ]
    return "\n".join(rows) + "\n"


DOC = Path("docs/trackers.md")


def main(argv: list[str] | None = None) -> int:
    """Rewrite the table of ``docs/trackers.md``, or with ``--check`` fail when stale."""
    from traceml_ai import _docs_tables

    return _docs_tables.main(
        "python -m traceml_ai.monitor.tracker_metrics",
        "tracker metrics",
        DOC,
        "tracker-metrics",
        tracker_metrics_markdown,
        argv,
    )


if __name__ == "__main__":
    sys.exit(main())
