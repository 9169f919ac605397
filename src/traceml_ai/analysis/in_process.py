"""``traceml.summary()`` / ``final_summary()``: the run's summary on rank 0, from the
same engine as ``traceml summary``.

Two sources, said in the result's ``source``:

* ``export``: under ``traceml run`` with the jsonl exporter writing ``step_time``, the
  aggregator's ``step_time.jsonl`` (every rank's steps). The rank first sends what
  it has, then polls the file until its own last step is there (up to
  ``timeout_sec``): figures of other ranks cover what they had sent by then, and
  the final figures of a run come with the closing lines, after the run.
* ``in_process``: with export off there are no files; the figures are this rank's
  own recent steps (``rank._timing.step_recorder.StepHistory``, kept in the process).

The summary figures' names for experiment trackers are declared here once
(:data:`SUMMARY_FIELDS`, built by :func:`summary_fields` and :func:`step_fields`):
``traceml.summary()``'s flat dict (:func:`compact`) and the summary each tracker run
gets at the end (``monitor.trackers``) use them; here, because the rank builds its
dict without the monitor package.

Light: never imports torch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from traceml_ai.analysis._figures import step_figures
from traceml_ai.analysis._model import RunSummary, StepFigures, StepRows
from traceml_ai.analysis._phases import rounded, step_row
from traceml_ai.analysis._straggler import StragglerView
from traceml_ai.analysis._summarize import summarize_run
from traceml_ai.analysis._text import format_summary
from traceml_records.internal import FileScan

# -- the summary figures' names: one key set, for traceml.summary() and the trackers ----


@attrs.frozen
class TrackerMetric:
    """One figure logged to an experiment tracker: its name (``<phase>`` or ``<rank>``
    stand for a value), its unit and what it is."""

    name: str
    unit: str
    help: str

    def format(self, **values: object) -> str:
        """The name with its placeholders filled (``phase=``, ``rank=``)."""
        name = self.name
        for key, value in values.items():
            name = name.replace(f"<{key}>", str(value))
        return name


# The run summary's figures under one key set: the flat dict of ``traceml.summary()``
# (:func:`compact`) and the summary each tracker run gets at the end
# (``monitor.trackers``) use these names, built by :func:`summary_fields`. The step
# figures keep 0.5.0's names (``traceml/step_time/...``); the docs' table is
# ``monitor.tracker_metrics``'s.
SUMMARY_SOURCE = TrackerMetric(
    "traceml/source",
    "text",
    "Where the figures come from: export (the export files; every tracker run) or "
    "in_process (the rank's own recent steps: `traceml.summary()` with export off).",
)
SUMMARY_COMPLETE = TrackerMetric(
    "traceml/complete",
    "bool",
    "`traceml.summary()` only: whether the figures are the run's final ones.",
)
RANKS = TrackerMetric(
    "traceml/ranks",
    "ranks",
    "Ranks the figures cover: those with the logged step (a point), those with steps "
    "(the summary).",
)
SUMMARY_STEPS = TrackerMetric("traceml/steps", "steps", "The most steps any rank has.")
SUMMARY_STEP_TIME_MEAN = TrackerMetric(
    "traceml/step_time/step_time_ms",
    "ms",
    "Mean over ranks of each rank's mean step time.",
)
SUMMARY_STEP_TIME_P50 = TrackerMetric(
    "traceml/step_time/step_time_p50_ms",
    "ms",
    "Mean over ranks of each rank's median step time.",
)
SUMMARY_STEP_TIME_P99 = TrackerMetric(
    "traceml/step_time/step_time_p99_ms",
    "ms",
    "The highest of the ranks' 99th percentile step times.",
)
SUMMARY_STEP_TIME_MAX = TrackerMetric(
    "traceml/step_time/step_time_max_ms", "ms", "The longest step of any rank."
)
SUMMARY_STEPS_PER_S = TrackerMetric(
    "traceml/step_time/steps_per_s",
    "steps/s",
    "Mean over ranks of each rank's steps per second over the run.",
)
SUMMARY_PHASE_MS = TrackerMetric(
    "traceml/step_time/<phase>_ms",
    "ms",
    "Mean over ranks of each rank's mean time per step in the phase, by 0.5.0's names: "
    "input_wait (dataloader_wait), h2d, forward, backward, optimizer, residual (the "
    "rest of the step).",
)
SUMMARY_VERDICT = TrackerMetric(
    "traceml/summary/verdict",
    "text",
    "The straggler verdict of the run summary: straggler, intermittent, slow_stage, "
    "data_imbalance, none or n/a.",
)
SUMMARY_SLOWDOWN = TrackerMetric(
    "traceml/summary/slowdown",
    "ratio",
    "What the verdict's cause costs: the step time over the step time without it "
    "(replayed); left out when the verdict names none.",
)
SUMMARY_SLOW_STAGE = TrackerMetric(
    "traceml/summary/slow_stage",
    "stage",
    "The slow pipeline stage the verdict (or its `also`) names first; -1 when none.",
)
SUMMARY_STRAGGLER_RANK = TrackerMetric(
    "traceml/summary/straggler_rank",
    "rank",
    "The rank the verdict names first (the largest excess); -1 when it names none.",
)
SUMMARY_STRAGGLER_EXCESS_MS = TrackerMetric(
    "traceml/summary/straggler_excess_ms",
    "ms",
    "How much longer that rank's own work takes per step than the other ranks'; 0 "
    "when the verdict names none.",
)
SUMMARY_STRAGGLER_PHASE = TrackerMetric(
    "traceml/summary/straggler_phase",
    "text",
    "Where that rank's extra time sits (a phase name); left out when the verdict names none.",
)
SUMMARY_PEAK_ALLOCATED = TrackerMetric(
    "traceml/summary/peak_allocated_bytes",
    "bytes",
    "The highest peak allocated device memory of any rank and device; left out "
    "without step_memory.",
)
SUMMARY_FILES = TrackerMetric(
    "traceml/summary/files",
    "text",
    "What the files say about loss: complete, or the status the summary gives.",
)

SUMMARY_FIELDS: tuple[TrackerMetric, ...] = (
    SUMMARY_SOURCE,
    SUMMARY_COMPLETE,
    RANKS,
    SUMMARY_STEPS,
    SUMMARY_STEP_TIME_MEAN,
    SUMMARY_STEP_TIME_P50,
    SUMMARY_STEP_TIME_P99,
    SUMMARY_STEP_TIME_MAX,
    SUMMARY_STEPS_PER_S,
    SUMMARY_PHASE_MS,
    SUMMARY_VERDICT,
    SUMMARY_SLOWDOWN,
    SUMMARY_SLOW_STAGE,
    SUMMARY_STRAGGLER_RANK,
    SUMMARY_STRAGGLER_EXCESS_MS,
    SUMMARY_STRAGGLER_PHASE,
    SUMMARY_PEAK_ALLOCATED,
    SUMMARY_FILES,
)
"""The run summary's figures, in the docs' order."""

SUMMARY_PHASES = (
    ("dataloader_wait", "input_wait"),
    ("h2d", "h2d"),
    ("forward", "forward"),
    ("backward", "backward"),
    ("optimizer", "optimizer"),
    ("rest", "residual"),
)
"""The summary's phase names and their ``<phase>`` in :data:`SUMMARY_PHASE_MS` (0.5.0's)."""

Events = Mapping[str, Any]
_API_KEYS = ("source", "complete", "file")
"""What ``final_summary()`` adds to the run summary's JSON."""


# -- figures ------------------------------------------------------------------------


def figures(steps_by_rank: Mapping[int, Mapping[int, Events]]) -> StepFigures:
    """The same figures as ``traceml summary``'s
    (:func:`~traceml_ai.analysis.step_figures`) of each rank's step events."""
    rows: StepRows = {}
    for rank, steps in steps_by_rank.items():
        kept = {s: r for s in sorted(steps) if (r := step_row(steps[s])) is not None}
        if kept:
            rows[rank] = kept
    return step_figures(rows)


def build_summary(
    steps_by_rank: Mapping[int, Mapping[int, Events]],
    *,
    source: str,
    complete: bool,
    notes: Iterable[str] = (),
    **extra: Any,
) -> dict[str, Any]:
    """The structured summary ``final_summary()`` returns."""
    from traceml_ai._converter import unstructure

    got = figures(steps_by_rank)
    out: dict[str, Any] = {
        "source": source,
        "complete": complete,
        **extra,
        "ranks": sorted(int(r) for r in got.step_time),
        "step_time": unstructure(got.step_time) or None,
        "phases": unstructure(got.phases) or None,
        "phase_names": got.phase_names,
        "notes": list(notes),
    }
    if not got.step_time:
        out["notes"].append("step times: no step recorded")
    return out


def step_fields(
    step_time: Mapping[str, Mapping[str, Any]] | None,
    phases: Mapping[str, Mapping[str, Any]] | None,
) -> dict[str, float]:
    """The step figures of :data:`SUMMARY_FIELDS` from a summary's ``step_time`` and
    ``phases`` (their JSON form: rank -> figures); empty without steps."""
    ranks = [r for r in (step_time or {}).values() if isinstance(r, Mapping)]
    if not ranks:
        return {}

    def mean_of(values: list[float]) -> float:
        return rounded(sum(values) / len(values))

    out: dict[str, float] = {
        RANKS.name: len(ranks),
        SUMMARY_STEPS.name: max(int(r.get("steps", 0)) for r in ranks),
        SUMMARY_STEP_TIME_MEAN.name: mean_of([float(r["mean_ms"]) for r in ranks]),
        SUMMARY_STEP_TIME_P50.name: mean_of([float(r["p50_ms"]) for r in ranks]),
    }
    if all("p99_ms" in r for r in ranks):
        out[SUMMARY_STEP_TIME_P99.name] = rounded(max(float(r["p99_ms"]) for r in ranks))
    out[SUMMARY_STEP_TIME_MAX.name] = rounded(max(float(r["max_ms"]) for r in ranks))
    if all("steps_per_s" in r for r in ranks):
        out[SUMMARY_STEPS_PER_S.name] = mean_of([float(r["steps_per_s"]) for r in ranks])
    if isinstance(phases, Mapping):
        for name, key in SUMMARY_PHASES:
            values = [
                float(p[name]["mean_ms"])
                for p in phases.values()
                if isinstance(p, Mapping) and isinstance(p.get(name), Mapping)
            ]
            if values:
                out[SUMMARY_PHASE_MS.format(phase=key)] = mean_of(values)
    return {k: v for k, v in out.items() if math.isfinite(v)}


def summary_fields(summary: RunSummary) -> dict[str, float | str]:
    """The run summary's figures by :data:`SUMMARY_FIELDS` name (a figure the summary
    has not is left out): what each tracker run gets at the end, and what
    ``traceml.summary()`` gives from the export files."""
    fields: dict[str, float | str] = {SUMMARY_SOURCE.name: "export"}
    json = summary.to_json()
    fields.update(step_fields(json.get("step_time"), json.get("phases")))
    fields[RANKS.name] = len(summary.ranks)
    view = summary.straggler
    if view is not None:
        fields[SUMMARY_VERDICT.name] = view.verdict
        if view.stragglers:
            first = max(view.stragglers, key=lambda s: s.excess_ms)
            fields[SUMMARY_STRAGGLER_RANK.name] = first.rank
            fields[SUMMARY_STRAGGLER_EXCESS_MS.name] = first.excess_ms
            fields[SUMMARY_STRAGGLER_PHASE.name] = first.phase
        elif view.applicable:
            fields[SUMMARY_STRAGGLER_RANK.name] = -1
            fields[SUMMARY_STRAGGLER_EXCESS_MS.name] = 0.0
        if view.slowdown is not None:
            fields[SUMMARY_SLOWDOWN.name] = view.slowdown.factor
        if view.applicable:
            fields[SUMMARY_SLOW_STAGE.name] = slow_stage(view)
    peaks = [
        peak.peak_allocated_bytes
        for devices in (summary.memory or {}).values()
        for peak in devices.values()
        if peak.peak_allocated_bytes is not None
    ]
    if peaks:
        fields[SUMMARY_PEAK_ALLOCATED.name] = max(peaks)
    fields[SUMMARY_FILES.name] = summary.loss.status
    return {k: v for k, v in fields.items() if isinstance(v, str) or math.isfinite(v)}


def slow_stage(view: StragglerView) -> int:
    """The slow stage the view names first (its verdict's, else its ``also``'s); -1."""
    for cause in view.causes():
        if cause.stages:
            stage: int = max(cause.stages, key=lambda s: s.excess_ms).stage
            return stage
    return -1


def compact(summary: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A flat dict for experiment trackers: the figures of :data:`SUMMARY_FIELDS` the
    summary has (0.5.0's ``summary()`` keys among them), with ``traceml/source`` and
    ``traceml/complete``."""
    if summary is None:
        return None
    out: dict[str, Any] = {}
    if "export_folder" in summary:
        try:
            own = {k: v for k, v in summary.items() if k not in _API_KEYS}
            out.update(summary_fields(RunSummary.from_json(own)))
        except Exception:
            out.clear()  # the step figures below need only the step rows
    if not out:
        out.update(step_fields(summary.get("step_time"), summary.get("phases")))
    for field in (SUMMARY_SOURCE, SUMMARY_COMPLETE):
        value = summary.get(field.name.removeprefix("traceml/"))
        if isinstance(value, (str, bool)):
            out[field.name] = value
    return out


def full_analysis(
    step_time_file: Path, *, complete: bool, notes: Sequence[str]
) -> dict[str, Any] | None:
    """The run's full summary (``traceml summary``'s) from its export folder, or None.

    It has every figure of the export files (memory, process, system, the straggler
    view) besides the step and phase figures; None when it cannot be read, and the
    caller falls back to :func:`build_summary` over the lines it read itself.
    """
    try:
        full = summarize_run(step_time_file.parent).to_json()
    except Exception:
        return None
    return {
        "source": "export",
        "complete": complete,
        "file": str(step_time_file),
        **full,
        "notes": [*notes, *full["notes"]],
    }


def text(summary: Mapping[str, Any]) -> str:
    """A few ``traceml:`` lines: one per rank, then the notes."""
    if "export_folder" in summary:
        try:
            own = {k: v for k, v in summary.items() if k not in _API_KEYS}
            return format_summary(RunSummary.from_json(own), full=True)
        except Exception:
            pass  # the few lines below need only the step figures
    where = "export files" if summary.get("source") == "export" else "this rank's own steps"
    state = "" if summary.get("complete") else ", run still in progress"
    lines = [f"traceml: summary from {where}{state}"]
    per_rank = summary.get("step_time") or {}
    phases = summary.get("phases") or {}
    for rank, fig in per_rank.items():
        parts = [
            f"{name} {info['mean_ms']:.2f} ms"
            for name, info in (phases.get(rank) or {}).items()
            if info.get("mean_ms")
        ]
        lines.append(
            f"traceml: rank {rank}: {fig['steps']} steps, step p50 {fig['p50_ms']:.2f} ms, "
            f"mean {fig['mean_ms']:.2f} ms, max {fig['max_ms']:.2f} ms"
            + (f"; mean per step: {', '.join(parts)}" if parts else "")
        )
    for note in summary.get("notes") or ():
        lines.append(f"traceml: note: {note}")
    return "\n".join(lines)


# -- the export file ----------------------------------------------------------------


class StepTimeFile:
    """Reads a growing ``step_time.jsonl`` incrementally with the one scan of the export
    files (a partial last line waits; only valid lines, the first of each key, before
    the closing line, are taken)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._scan = FileScan("step_time", objects=True)
        self.steps: dict[int, dict[int, Events]] = {}

    @property
    def closed(self) -> bool:
        """The closing line has been read."""
        return self._scan.state.closing_line is not None

    def read_new(self) -> None:
        """Take the lines written since the last call; a missing file is no line yet."""
        try:
            with open(self.path, "rb") as fh:
                objs = self._scan.read(fh)
        except OSError:
            return
        for obj in objs:
            self.steps.setdefault(obj["global_rank"], {})[obj["step"]] = obj["events"]

    def has(self, rank: int, step: int) -> bool:
        """Whether ``rank``'s step ``step`` (or a later one) is in the file."""
        steps = self.steps.get(rank)
        return steps is not None and max(steps, default=0) >= step


def wait_for_file(
    path: Path, rank: int, last_step: int, timeout_s: float, poll_s: float
) -> tuple[StepTimeFile, bool]:
    """Poll ``path`` until ``rank``'s ``last_step`` is there or the file is closed.

    Returns the read file and whether that happened within ``timeout_s``.
    """
    reader = StepTimeFile(path)
    deadline = time.monotonic() + max(0.0, timeout_s)
    poll = min(max(poll_s, 0.01), 1.0)
    while True:
        reader.read_new()
        if reader.closed or last_step <= 0 or reader.has(rank, last_step):
            return reader, True
        if time.monotonic() >= deadline:
            return reader, False
        time.sleep(poll)
