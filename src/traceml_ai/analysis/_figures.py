"""The figures of each stream of a run, from what the reader kept of its lines: step
figures and the phase breakdown per rank (of step columns), the collectives' waits
merged into the step columns, peak memory (the process and node figures are
:mod:`._running`'s).

Light to import: numpy and the package's own modules (never torch, never pyarrow).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from traceml_ai.analysis._causes import Layout
from traceml_ai.analysis._columns import (
    Column,
    RankColumns,
    StepColumns,
    columns_of_rows,
    is_columns,
)
from traceml_ai.analysis._model import (
    DevicePeak,
    PhaseFigures,
    RankSteps,
    RunSummary,
    StepFigures,
    StepRows,
)
from traceml_ai.analysis._phases import (
    percentiles,
    phase_breakdown,
    phase_names,
    rounded,
    waits_measured,
)
from traceml_ai.analysis._read import WaitLines
from traceml_ai.analysis._straggler import StragglerView
from traceml_ai.analysis._straggler import analyze as analyze_stragglers


def step_figures(rows: StepRows | StepColumns, *, phases: bool = True) -> StepFigures:
    """Per-rank step figures, per-rank phase breakdown and the phase names, in order, of
    step columns or rows (rank -> step -> :class:`StepRow`). Without ``phases`` the
    breakdown is left empty (:func:`rank_phases` gives any rank's when asked)."""
    columns: StepColumns = rows if is_columns(rows) else columns_of_rows(rows)  # type: ignore[assignment,arg-type]
    with np.errstate(all="ignore"):
        return _step_figures(columns, phases)


def rank_phases(columns: RankColumns, names: Sequence[str]) -> dict[str, PhaseFigures]:
    """One rank's phase breakdown (phase -> its figures), as :func:`step_figures` gives it."""
    with np.errstate(all="ignore"):
        return {name: PhaseFigures(**f) for name, f in phase_breakdown(columns, names).items()}


def _step_figures(columns: StepColumns, with_phases: bool = True) -> StepFigures:
    names = phase_names(
        [c.phases for c in columns.values()]
        + [c.totals.phase_sums for c in columns.values() if c.totals is not None]
    )
    per_rank: dict[str, RankSteps] = {}
    phases: dict[str, dict[str, PhaseFigures]] = {}
    for rank in sorted(columns):
        c = columns[rank]
        t = c.totals
        if t is not None and t.steps:
            # A sample of the rank's steps: the exact figures from its totals, the
            # percentiles from the sample (the mean where the sample holds none).
            count, first, last = t.steps, t.first_step, t.last_step
            average = t.step_sum / count
            longest = t.max_ms
            span_s = (t.last_end - t.first_end) / 1e9 if t.ends >= 2 else 0.0
            stamped = t.ends
            p50, p90, p99 = percentiles(c.step_ms, (50.0, 90.0, 99.0)) if len(c) else [average] * 3
        elif len(c):
            times = c.step_ms
            count, first, last = len(times), int(c.steps[0]), int(c.steps[-1])
            ts = c.ends()
            stamps = ts[ts > 0]
            span_s = float(stamps.max() - stamps.min()) / 1e9 if len(stamps) >= 2 else 0.0
            stamped = len(stamps)
            average = float(times.sum() / len(times))
            longest = float(times.max())
            p50, p90, p99 = percentiles(times, (50.0, 90.0, 99.0))
        else:
            continue
        # Steps per second over the wall time between the first and last step ends
        # (includes time between steps); from the mean step time when that is unknown.
        if span_s > 0:
            rate = (stamped - 1) / span_s
        elif average > 0:
            rate = 1000.0 / average
        else:
            rate = 0.0
        per_rank[str(rank)] = RankSteps(
            steps=count,
            first_step=first,
            last_step=last,
            p50_ms=rounded(p50),
            p90_ms=rounded(p90),
            p99_ms=rounded(p99),
            max_ms=rounded(longest),
            mean_ms=rounded(average),
            steps_per_s=rounded(rate),
        )
        if with_phases:
            phases[str(rank)] = rank_phases(c, names)
    return StepFigures(step_time=per_rank, phases=phases, phase_names=names)


def straggler_view(
    columns: StepColumns, strategy: str | None, collectives: bool, layout: Layout | None
) -> StragglerView:
    """The straggler analysis (:mod:`traceml_ai.analysis._straggler`) of the step rows."""
    nodes = {rank: c.node for rank, c in columns.items() if c.node is not None}
    return analyze_stragglers(columns, strategy, nodes, collectives, layout)


def merge_waits(columns: StepColumns, waits: WaitLines, notes: list[str]) -> bool:
    """Add the collectives file's waits to the step columns (those of the steps they
    hold); whether every rank's were measured (the straggler analysis then uses them)."""
    names = {i: key for key, i in waits.names.items()}
    for rank, (at, keys, values) in waits.by_rank().items():
        mine = columns.get(rank)
        if mine is None or not len(at):
            continue
        pos = np.searchsorted(mine.steps, at)
        found = pos < len(mine.steps)
        found[found] = mine.steps[pos[found]] == at[found]
        for i in np.unique(keys[found]):
            pick = found & (keys == i)
            total = np.zeros(len(mine.steps), dtype=np.float64)
            np.add.at(total, pos[pick], values[pick])
            had = np.zeros(len(mine.steps), dtype=np.bool_)
            had[pos[pick]] = True
            component, op = names[int(i)]
            if op is None:
                mine.waits[component] = Column(total, had)
            else:
                mine.op_waits[(component, op)] = Column(total, had)
    unseen = sorted(r for r in columns if r not in waits.seen)
    if len(columns) > 1 and unseen:
        shown = ", ".join(map(str, unseen[:10])) + (", ..." if len(unseen) > 10 else "")
        notes.append(
            f"collectives: none seen on rank(s) {shown} (an engine that bypasses "
            "torch.distributed's Python functions, or a built-in DDP hook registered "
            "before the first forward); the wait is inferred from phase times"
        )
    if waits.unmeasured:
        shown = ", ".join(map(str, sorted(waits.unmeasured)[:10]))
        notes.append(
            f"collectives: wait not measured on rank(s) {shown} (NCCL without "
            "TORCH_NCCL_ENABLE_TIMING=1); the wait is inferred from phase times"
        )
    return waits_measured(columns, waits.seen, waits.unmeasured)


class MemoryPeaks:
    """rank -> device -> peaks of the step_memory lines, as they are read."""

    def __init__(self) -> None:
        self.peaks: dict[int, dict[str, dict[str, int | None]]] = {}
        self.any_figure = False

    def add(self, obj: Mapping[str, Any]) -> None:
        rank, device = obj.get("global_rank"), obj.get("device")
        if not isinstance(rank, int) or not isinstance(device, str):
            return
        slot = self.peaks.setdefault(rank, {}).setdefault(
            device, {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
        )
        for key in ("peak_allocated_bytes", "peak_reserved_bytes"):
            v = obj.get(key)
            if isinstance(v, int):
                self.any_figure = True
                old = slot[key]
                slot[key] = v if old is None else max(old, v)

    def section(self) -> dict[str, dict[str, DevicePeak]]:
        return {
            str(r): {device: DevicePeak(**figures) for device, figures in self.peaks[r].items()}
            for r in sorted(self.peaks)
        }


def step_series(summary: RunSummary) -> dict[int, list[tuple[int, float]]]:
    """rank -> [(step, step time in ms)] in step order, for plots; {} without steps."""
    rows = summary.rows
    return {
        r: list(zip(c.steps.tolist(), c.step_ms.tolist(), strict=True))
        for r, c in sorted(rows.items())
    }
