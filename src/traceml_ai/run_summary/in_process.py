"""``traceml.summary()`` / ``final_summary()``: the run's summary on rank 0, from the
same engine as ``traceml summary``.

Two sources, said in the result's ``source``:

* ``export``: under ``traceml run`` with the jsonl exporter writing ``step_time``, the
  aggregator's ``step_time.jsonl`` (every rank's steps). The rank first sends what
  it has, then polls the file until its own last step is there (up to
  ``timeout_sec``): figures of other ranks cover what they had sent by then, and
  the final figures of a run come with the closing lines, after the run.
* ``in_process``: with export off there are no files; the figures are this rank's
  own recent steps (``_step_recorder.StepHistory``, kept in the process).

Light: never imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from traceml_ai.run_summary._figures import step_figures
from traceml_ai.run_summary._model import RunSummary, StepFigures, StepRows
from traceml_ai.run_summary._phases import rounded, step_row
from traceml_ai.run_summary._report import summarize_run
from traceml_ai.run_summary._text import format_summary
from traceml_records.internal import LineKind, LineSplitter, classify_line

# 0.5.0's compact keys (traceml/step_time/<metric>) for the phases this project measures.
_COMPACT_PHASES = (
    ("dataloader_wait", "input_wait_ms"),
    ("h2d", "h2d_ms"),
    ("forward", "forward_ms"),
    ("backward", "backward_ms"),
    ("optimizer", "optimizer_ms"),
    ("rest", "residual_ms"),
)

Events = Mapping[str, Any]
_API_KEYS = ("source", "complete", "file")
"""What ``final_summary()`` adds to the run summary's JSON."""


# -- figures ------------------------------------------------------------------------


def figures(steps_by_rank: Mapping[int, Mapping[int, Events]]) -> StepFigures:
    """The same figures as ``traceml summary``'s
    (:func:`~traceml_ai.run_summary.step_figures`) of each rank's step events."""
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


def compact(summary: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """A flat dict for experiment trackers (``traceml/...`` keys, as 0.5.0's ``summary()``).

    Step-time figures are the mean over ranks of each rank's mean.
    """
    if summary is None:
        return None
    out: dict[str, Any] = {}
    for key in ("source", "complete"):
        value = summary.get(key)
        if isinstance(value, (str, bool)):
            out[f"traceml/{key}"] = value
    per_rank = summary.get("step_time")
    phases = summary.get("phases")
    if not isinstance(per_rank, Mapping) or not per_rank:
        return out
    ranks = list(per_rank.values())
    out["traceml/ranks"] = len(ranks)
    out["traceml/steps"] = max(int(r.get("steps", 0)) for r in ranks)

    def mean_of(values: list[float]) -> float:
        return rounded(sum(values) / len(values))

    out["traceml/step_time/step_time_ms"] = mean_of([float(r["mean_ms"]) for r in ranks])
    out["traceml/step_time/step_time_p50_ms"] = mean_of([float(r["p50_ms"]) for r in ranks])
    out["traceml/step_time/step_time_max_ms"] = rounded(max(float(r["max_ms"]) for r in ranks))
    if isinstance(phases, Mapping):
        for name, key in _COMPACT_PHASES:
            values = [
                float(p[name]["mean_ms"])
                for p in phases.values()
                if isinstance(p, Mapping) and isinstance(p.get(name), Mapping)
            ]
            if values:
                out[f"traceml/step_time/{key}"] = mean_of(values)
    return out


def full_run_summary(
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
    """Reads a growing ``step_time.jsonl`` incrementally (a partial last line waits)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._lines = LineSplitter()
        self.steps: dict[int, dict[int, Events]] = {}
        self.closed = False

    def read_new(self) -> None:
        """Take the lines written since the last call; a missing file is no line yet."""
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self._offset)
                data = fh.read()
        except OSError:
            return
        self._offset += len(data)
        for raw in self._lines.feed(data):
            kind, obj = classify_line(raw)
            if kind is LineKind.CLOSING:
                self.closed = True
            elif obj is not None:
                rank, step, events = obj.get("global_rank"), obj.get("step"), obj.get("events")
                if isinstance(rank, int) and isinstance(step, int) and isinstance(events, dict):
                    self.steps.setdefault(rank, {})[step] = events

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
