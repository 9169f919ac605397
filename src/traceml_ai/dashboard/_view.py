"""The one view builder: what the dashboard page shows, as one JSON-able dict.

Both sources — the aggregator's live state (``traceml run --mode dashboard``) and a
run's export files (``traceml dashboard FOLDER``) — are first turned into a
:class:`RunData` in the run summary's own typed values (per-rank step figures and phase
breakdown from :func:`traceml_ai.analysis.step_figures`, the straggler view of
:func:`traceml_ai.analysis.analyze`, said with its ``verdict_line``),
and :func:`build_view` makes the page's JSON from it. So both commands show the same
page, in the words of ``traceml summary``.

Readable for many ranks: step time over steps is the median over ranks with the
10th-90th percentile band, plus the stragglers' and slowest ranks' own lines (every
rank's line up to :data:`ALL_LINES_UP_TO` ranks); any rank's own line on demand
(``extra_ranks``). Long runs are binned to at most :data:`MAX_POINTS` points. Above
:data:`GROUPS_FROM` ranks the page groups the ranks by node (and by pipeline stage and
data-parallel group when the ranks said their coordinates): per group the distribution
of its ranks' median step times, the slowest groups in a table of at most
:data:`MAX_GROUP_ROWS` rows, and the outlier ranks (the named stragglers, then the
slowest) in the rank table of at most :data:`MAX_TABLE_ROWS` rows. The JSON's size
then grows only with the number of groups (one figure triple per group, for the chart),
never with the number of ranks.
"""

from __future__ import annotations

import heapq
import math
import shlex
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np
from numpy.typing import NDArray

from traceml_ai.analysis import (
    OTHER_PHASE,
    Coordinates,
    PhaseFigures,
    RankColumns,
    RankSteps,
    StragglerView,
    UserPhaseFold,
    cost_line,
    percentile,
    verdict_line,
)

__all__ = [
    "ALL_LINES_UP_TO",
    "GROUPS_FROM",
    "HIGHLIGHT",
    "MAX_EXTRA_RANKS",
    "MAX_GROUP_POINTS",
    "MAX_GROUP_ROWS",
    "MAX_POINTS",
    "MAX_STAGES",
    "MAX_TABLE_ROWS",
    "PHASE_COLOURS",
    "USER_PHASE_COLOURS",
    "VIEW_VERSION",
    "LazySeries",
    "RunData",
    "StepSeries",
    "build_view",
    "files_command",
    "outlier_ranks",
    "rank_medians",
]

VIEW_VERSION = 1
MAX_POINTS = 600
"""Points per line at most: longer runs are binned (each point the mean of its bin)."""
ALL_LINES_UP_TO = 8
"""Up to this many ranks, every rank has its own line; above, median and band."""
HIGHLIGHT = 5
"""Ranks drawn as their own line above ALL_LINES_UP_TO: the stragglers, then the slowest."""
MAX_TABLE_ROWS = 16
"""Rows of the per-rank tables: the named ranks (at most ``MAX_TABLE_ROWS - HIGHLIGHT``
of them), then the slowest p50 (every rank of a job this small); the distribution
across ranks, the groups and the stages stand for the rest."""
GROUPS_FROM = 65
"""From this many ranks the page groups them (by node, stage, data-parallel group);
a smaller job's page shows its ranks one by one, as it always did."""
MAX_GROUP_ROWS = 16
"""Rows of each group table: the groups holding a named rank, then the slowest."""
MAX_GROUP_POINTS = 4096
"""Groups whose figures the group chart draws (every group up to this many)."""
MAX_STAGES = 64
"""Pipeline stages the page lists."""
MAX_EXTRA_RANKS = 16
"""Ranks the page may ask to be drawn on their own (*Show rank*, ``?ranks=``)."""

PHASE_COLOURS: Mapping[str, str] = {
    "dataloader_wait": "#8c564b",
    "h2d": "#e377c2",
    "forward": "#1f77b4",
    "backward": "#2ca02c",
    "optimizer": "#ff7f0e",
    OTHER_PHASE: "#7f7f7f",
    "rest": "#c7c7c7",
}
"""The colour of each phase every run may have: the same on every page, whatever else
the chart holds."""
USER_PHASE_COLOURS: tuple[str, ...] = (
    "#9467bd", "#d62728", "#17becf", "#bcbd22", "#393b79", "#e7ba52", "#843c39", "#a55194",
)  # fmt: skip
"""The user phases' colours, in the order the page keeps them: one for each of the
``MAX_USER_PHASES`` it draws (the rest are ``other``), none of them a built-in's."""

Series = Mapping[int, "Sequence[tuple[int, float, float]] | RankColumns"]
"""rank -> its steps in step order: (step, step ms, end ns) tuples, or the files' step
columns as they are."""


@attrs.frozen(eq=False)
class StepSeries:
    """Every rank's steps as four flat columns, one row per step: each rank's rows
    together, in step order. The page's lines over steps are made from it by numpy,
    whatever the number of ranks."""

    rank: NDArray[np.int64]
    step: NDArray[np.int64]
    step_ms: NDArray[np.float64]
    end_ns: NDArray[np.float64]

    @classmethod
    def of(cls, series: Series) -> StepSeries:
        """The columns of ``series`` (tuples or step columns, rank by rank)."""
        ranks: list[NDArray[np.int64]] = []
        steps: list[NDArray[np.int64]] = []
        ms: list[NDArray[np.float64]] = []
        ends: list[NDArray[np.float64]] = []
        for r, rows in series.items():
            if isinstance(rows, RankColumns):
                s, m, e = rows.steps, rows.step_ms, rows.ends()
            else:
                s = np.array([t[0] for t in rows], dtype=np.int64)
                m = np.array([t[1] for t in rows], dtype=np.float64)
                e = np.array([t[2] for t in rows], dtype=np.float64)
            ranks.append(np.full(len(s), r, dtype=np.int64))
            steps.append(np.asarray(s, dtype=np.int64))
            ms.append(np.asarray(m, dtype=np.float64))
            ends.append(np.asarray(e, dtype=np.float64))
        if not ranks:
            return cls.empty()
        return cls(np.concatenate(ranks), np.concatenate(steps), np.concatenate(ms),
                   np.concatenate(ends))  # fmt: skip

    @classmethod
    def empty(cls) -> StepSeries:
        return cls(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0), np.zeros(0))

    def ranks(self) -> list[int]:
        """The ranks with rows, in row order."""
        return [int(r) for r in self.runs()[0]]

    def runs(self) -> tuple[NDArray[np.int64], NDArray[np.int64], NDArray[np.int64]]:
        """(each rank's number, each row's rank's index among them, rows per rank), read
        off the runs of equal ranks (each rank's rows are together): no sort."""
        n = len(self.rank)
        starts = (
            np.flatnonzero(np.r_[True, self.rank[1:] != self.rank[:-1]])
            if n
            else np.zeros(0, np.int64)
        )
        counts = np.diff(np.r_[starts, n]).astype(np.int64)
        index = np.repeat(np.arange(len(starts), dtype=np.int64), counts)
        return self.rank[starts], index, counts

    def step_index(self) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
        """(every step number present, sorted; each row's step's index in it): by a
        table when the steps span a range not much longer than the rows, else a sort."""
        if not len(self.step):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        low, high = int(self.step.min()), int(self.step.max())
        if high - low <= 4 * len(self.step) + 1024:
            present = np.bincount(self.step - low, minlength=high - low + 1) > 0
            table = np.cumsum(present) - 1
            return np.flatnonzero(present) + low, table[self.step - low]
        steps = np.unique(self.step)
        return steps, np.searchsorted(steps, self.step)


class LazySeries:
    """Step columns made when first asked for, then kept: the live source's (reading
    every rank's recent steps is most of a large view's cost, and the page's first
    view, drawn before Plotly has loaded, has no chart to draw)."""

    def __init__(self, make: Callable[[], StepSeries]) -> None:
        self._make = make
        self._lock = threading.Lock()
        self._made: StepSeries | None = None

    def get(self) -> StepSeries:
        with self._lock:
            if self._made is None:
                self._made = self._make()
            return self._made


def rank_medians(series: StepSeries) -> dict[int, float]:
    """rank -> the median of its rows' step times (every rank, by one numpy sort)."""
    if not len(series.rank):
        return {}
    ids, index, counts = series.runs()
    (p50,) = _row_percentiles(_grid(index, counts, series.step_ms), (50.0,))
    return dict(zip(ids.tolist(), p50.tolist(), strict=True))


def _grid(
    index: NDArray[np.int64], counts: NDArray[np.int64], values: NDArray[np.float64]
) -> NDArray[np.float64]:
    """``values`` (sorted by ``index``) as one row per index, NaN after each row's own."""
    starts = np.zeros(len(counts), dtype=np.int64)
    starts[1:] = np.cumsum(counts)[:-1]
    place = np.arange(len(index)) - starts[index]
    grid = np.full((len(counts), int(counts.max()) if len(counts) else 0), np.nan)
    grid[index, place] = values
    return grid


def _row_percentiles(grid: NDArray[np.float64], qs: Sequence[float]) -> list[NDArray[np.float64]]:
    """:func:`~traceml_ai.analysis.percentile` of each row's values (NaN: none), for
    each of ``qs``: the same interpolation, every row at once."""
    ordered = np.sort(grid, axis=1)  # NaN last
    count = np.count_nonzero(~np.isnan(grid), axis=1)
    rows = np.arange(len(grid))
    out = []
    for q in qs:
        pos = np.maximum(count - 1, 0) * (q / 100.0)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, np.maximum(count - 1, 0))
        low, high = ordered[rows, lo], ordered[rows, hi]
        with np.errstate(invalid="ignore"):
            value = low + (high - low) * (pos - lo)
        value[count == 0] = np.nan
        out.append(value)
    return out


def outlier_ranks(
    ranks: Sequence[int], named: Sequence[int], p50: Mapping[int, float]
) -> list[int]:
    """The ranks the per-rank tables show, in order: every rank up to
    :data:`MAX_TABLE_ROWS`; else the named ranks (at most ``MAX_TABLE_ROWS -
    HIGHLIGHT``), then the slowest by ``p50`` up to :data:`MAX_TABLE_ROWS` in all."""
    if len(ranks) <= MAX_TABLE_ROWS:
        return sorted(ranks)
    present = set(ranks)
    chosen = [r for r in dict.fromkeys(named) if r in present][: MAX_TABLE_ROWS - HIGHLIGHT]
    taken = set(chosen)
    rest = heapq.nsmallest(
        MAX_TABLE_ROWS - len(chosen),
        (r for r in ranks if r not in taken),
        key=lambda r: (-p50.get(r, 0.0), r),
    )
    return sorted([*chosen, *rest])


@attrs.frozen(kw_only=True)
class RunData:
    """One source's run, in the run summary's shapes."""

    source: Literal["live", "files"]
    finished: bool
    """Live: the aggregator finalized. Files: every file has its closing line."""
    status: str
    """One short phrase: ``training``, ``finalized``, ``files complete`` ..."""
    run_name: str | None = None
    run_folder: str | None = None
    export_folder: str | None = None
    host: str | None = None
    world_size: int | None = None
    strategy: str | None = None
    window: str = ""
    """What the step figures cover (``the last 120 steps of each rank`` ...)."""
    ranks: Sequence[int] = ()
    rank_nodes: Mapping[int, int] = attrs.field(factory=dict)
    layout: Mapping[int, Coordinates] = attrs.field(factory=dict)
    """rank -> its place in the parallel layout, for the ranks that said it."""
    total_steps: Mapping[int, int] = attrs.field(factory=dict)
    """Steps received or written per rank (the window may hold fewer)."""
    step_time: Mapping[str, RankSteps] | None = None
    """rank (str) -> its step figures."""
    phases: Mapping[str, Mapping[str, PhaseFigures]] | None = None
    """rank (str) -> phase -> its figures."""
    phase_names: Sequence[str] = ()
    straggler: StragglerView | None = None
    series: Series | StepSeries | LazySeries = attrs.field(factory=dict)
    rank_p50_ms: Mapping[int, float] | None = None
    """rank -> its median step time, every rank (None: ``step_time``'s, which then
    holds every rank)."""
    memory: Sequence[Mapping[str, Any]] | None = None
    """rank, device, peak_allocated_bytes, peak_reserved_bytes; None: not available."""
    memory_basis: str = ""
    process: Sequence[Mapping[str, Any]] | None = None
    """rank, cpu_percent, ram_used_bytes, gpu_memory_used_bytes, gpu_memory_reserved_bytes."""
    process_basis: str = ""
    system: Sequence[Mapping[str, Any]] | None = None
    """node, cpu_percent, ram_used_bytes, ram_total_bytes, gpus: [index, figures ...]."""
    system_basis: str = ""
    loss: Mapping[str, Any] = attrs.field(factory=dict)
    """status, lines (one sentence each), warning (finalization_warning.json or None)."""
    notes: Sequence[str] = ()
    problems: Sequence[str] = ()
    waiting: str | None = None
    """Why there is nothing to show yet (no export files, no step yet)."""


# --------------------------------------------------------------------------- helpers


def _finite(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None
    return round(x, 3)


def _bins(steps: int) -> int:
    """Steps per point, for ``steps`` steps."""
    return max(1, math.ceil(steps / MAX_POINTS))


def _x(steps: Sequence[int], size: int) -> list[int]:
    """The x of each bin: its last step."""
    return [steps[min(i + size, len(steps)) - 1] for i in range(0, len(steps), size)]


def _straggler_ranks(view: StragglerView | None) -> list[int]:
    return view.named_ranks if view is not None else []


# --------------------------------------------------------------------------- sections


def _finite_list(values: NDArray[np.float64]) -> list[float | None]:
    """:func:`_finite` of each value."""
    rounded = np.round(values, 3)
    return [v if math.isfinite(v) else None for v in rounded.tolist()]


Grids = tuple[NDArray[np.int64], NDArray[np.int64], int, NDArray[np.float64], NDArray[np.float64]]
"""(the ranks, every step present, steps per bin, each rank's mean step ms per bin, each
rank's mean ms between consecutive step ends per bin): a row per rank."""


def _bin_means(
    cell: NDArray[np.int64],
    cells: int,
    ranks: NDArray[np.int64] | None,
    steps: NDArray[np.int64],
    ms: NDArray[np.float64],
    ends: NDArray[np.float64],
) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
    """Per cell, the mean step time and the mean time between a step's end and the end
    of the step before it (where that is the row before, of the same rank)."""
    counts = np.bincount(cell, minlength=cells)
    sums = np.bincount(cell, weights=ms, minlength=cells)
    follows = np.zeros(len(cell), dtype=np.bool_)
    follows[1:] = steps[1:] == steps[:-1] + 1
    if ranks is not None:
        follows[1:] &= ranks[1:] == ranks[:-1]
    gap = np.zeros(len(cell))
    gap[1:] = (ends[1:] - ends[:-1]) / 1e6
    counted = follows & (gap > 0)
    gap_counts = np.bincount(cell[counted], minlength=cells)
    gap_sums = np.bincount(cell[counted], weights=gap[counted], minlength=cells)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (
            np.where(counts > 0, sums / counts, np.nan),
            np.where(gap_counts > 0, gap_sums / gap_counts, np.nan),
        )


def _grids(series: StepSeries | Mapping[int, RankColumns]) -> Grids | None:
    """The ranks x bins grids of ``series``: the flat columns at once; the files' step
    columns rank by rank (a long run's columns are not copied into one)."""
    if isinstance(series, StepSeries):
        if not len(series.step):
            return None
        all_steps, step_index = series.step_index()
        size = _bins(len(all_steps))
        n = math.ceil(len(all_steps) / size)
        ids, rank_row, _ = series.runs()
        cell = rank_row * n + step_index // size
        means, gaps = _bin_means(
            cell, len(ids) * n, series.rank, series.step, series.step_ms, series.end_ns
        )
        return ids, all_steps, size, means.reshape(len(ids), n), gaps.reshape(len(ids), n)
    columns = {r: c for r, c in series.items() if len(c)}
    if not columns:
        return None
    all_steps = np.unique(np.concatenate([c.steps for c in columns.values()]))
    size = _bins(len(all_steps))
    n = math.ceil(len(all_steps) / size)
    means = np.full((len(columns), n), np.nan)
    gaps = np.full((len(columns), n), np.nan)
    for i, c in enumerate(columns.values()):
        cell = np.searchsorted(all_steps, c.steps) // size
        means[i], gaps[i] = _bin_means(cell, n, None, c.steps, c.step_ms, c.ends())
    return np.array(list(columns), dtype=np.int64), all_steps, size, means, gaps


def _series(
    data: RunData,
    series: StepSeries | Mapping[int, RankColumns],
    highlight: Sequence[int],
    extra: Sequence[int],
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(step time over steps, throughput over steps).

    Per bin of steps, each rank's mean step time in the bin, then the median and
    10th/90th percentiles of those over ranks; and the job's steps per second: 1000
    over the median (over ranks) of each rank's mean time between consecutive steps'
    ends in the bin. All ranks at once by numpy: a grid of ranks x bins."""
    found = _grids(series)
    if found is None:
        return {"steps": [], "lines": []}, {"steps": [], "steps_per_s": []}
    ids, all_steps, size, means, gaps = found
    low, median, high = _row_percentiles(means.T, (10.0, 50.0, 90.0))
    (mid,) = _row_percentiles(gaps.T, (50.0,))
    with np.errstate(invalid="ignore", divide="ignore"):
        rate = np.where(mid > 0, 1000.0 / mid, np.nan)
    row_of = {int(r): i for i, r in enumerate(ids.tolist())}
    stragglers = set(_straggler_ranks(data.straggler))
    lines = [
        {
            "rank": r,
            "values": _finite_list(means[row_of[r]]),
            "straggler": r in stragglers,
            "on_demand": r not in highlight,
        }
        for r in [*highlight, *(r for r in extra if r not in highlight)]
        if r in row_of
    ]
    x = _x(all_steps.tolist(), size)
    step_chart = {
        "steps": x,
        "bin": size,
        "median": _finite_list(median),
        "p10": _finite_list(low),
        "p90": _finite_list(high),
        "lines": lines,
        "band": len(ids) > ALL_LINES_UP_TO,
    }
    return step_chart, {"steps": x, "bin": size, "steps_per_s": _finite_list(rate)}


def _verdict(data: RunData, ranks: Sequence[int]) -> str:
    if not ranks:
        return "straggler: no step times yet"
    if data.straggler is None:
        return "straggler: not analysed yet (the analysis runs every few seconds)"
    return verdict_line(data.straggler)


Folded = tuple[list[str], dict[str, dict[str, tuple[float, float]]]]
"""(the phases the page draws, in order; rank (str) -> phase -> (mean ms, share))."""


def _folded_phases(data: RunData, ranks: Sequence[int]) -> Folded:
    """The phases as the page draws them, for ``ranks`` (those of the per-rank tables;
    no other rank's phases are read): folded by the live views' one rule
    (:class:`~traceml_ai.analysis.UserPhaseFold`), so that the page from files keeps
    the phases the live page kept and ``other`` holds the rest, summed: each rank's bars
    still add up to its iteration."""
    fold = UserPhaseFold()
    label = {name: fold(name) for name in data.phase_names}
    names = list(dict.fromkeys(label.values()))
    per_rank: dict[str, dict[str, tuple[float, float]]] = {}
    phases = data.phases or {}
    for rank in map(str, ranks):
        figures = phases.get(rank)
        if figures is None:
            continue
        sums: dict[str, tuple[float, float]] = {}
        for name, f in figures.items():
            key = label.get(name) or fold(name)
            mean_ms, share = sums.get(key, (0.0, 0.0))
            sums[key] = (mean_ms + f.mean_ms, share + f.share)
        per_rank[rank] = {k: (round(m, 3), round(sh, 4)) for k, (m, sh) in sums.items()}
    return names, per_rank


def _colours(names: Sequence[str]) -> dict[str, str]:
    """Each drawn phase's colour: the built-ins' own, the user phases' in turn."""
    out: dict[str, str] = {}
    user = 0
    for name in names:
        if name in PHASE_COLOURS:
            out[name] = PHASE_COLOURS[name]
        else:
            out[name] = USER_PHASE_COLOURS[user % len(USER_PHASE_COLOURS)]
            user += 1
    return out


def _rank_table(data: RunData, shown: Sequence[int], folded: Folded) -> list[dict[str, Any]]:
    stragglers = set(_straggler_ranks(data.straggler))
    out = []
    step_time = data.step_time or {}
    phases = folded[1]
    for r in shown:
        s = step_time.get(str(r))
        if s is None:
            continue
        ph = phases.get(str(r)) or {}
        largest = max(ph, key=lambda n: ph[n][1]) if ph else None
        out.append(
            {
                "rank": r,
                "node": data.rank_nodes.get(r),
                "steps": data.total_steps.get(r, s.steps),
                "last_step": s.last_step,
                "p50_ms": s.p50_ms,
                "p90_ms": s.p90_ms,
                "p99_ms": s.p99_ms,
                "max_ms": s.max_ms,
                "steps_per_s": s.steps_per_s,
                "largest_phase": largest,
                "largest_phase_share": ph[largest][1] if largest else None,
                "straggler": r in stragglers,
            }
        )
    return out


def _phase_chart(folded: Folded, ranks: Sequence[int]) -> dict[str, Any]:
    names, phases = folded
    present = [r for r in ranks if str(r) in phases]

    def figure(r: int, name: str, share: bool) -> float:
        f = phases[str(r)].get(name)
        if f is None:
            return 0.0
        return f[1] if share else f[0]

    return {
        "names": names,
        "ranks": present,
        "mean_ms": {n: [figure(r, n, False) for r in present] for n in names},
        "share": {n: [figure(r, n, True) for r in present] for n in names},
        "colours": _colours(names),
    }


def _distribution(values: Sequence[float]) -> dict[str, float | None] | None:
    """min, p50, p90 and max of one figure across ranks."""
    ordered = sorted(v for v in values if math.isfinite(v))
    if not ordered:
        return None
    return {
        "min": ordered[0],
        "p50": percentile(ordered, 50.0),
        "p90": percentile(ordered, 90.0),
        "max": ordered[-1],
    }


def _spread(data: RunData, p50: Mapping[int, float]) -> list[dict[str, Any]]:
    """The figures across ranks, each as its distribution (the rows of *Across ranks*):
    over every rank (the p99 and the rate only where every rank's figures are here,
    not only the table's)."""
    steps = list((data.step_time or {}).values())
    if not p50:
        return []
    rows = [("step time p50 (ms)", list(p50.values()))]
    if len(steps) >= len(p50):
        rows.append(("step time p99 (ms)", [s.p99_ms for s in steps]))
        rows.append(("steps/s", [s.steps_per_s for s in steps]))
    own = data.straggler.own_work_ms if data.straggler else None
    if own:
        rows.append(("own work per iteration (ms)", list(own.values())))
    out = []
    for name, values in rows:
        found = _distribution(values)
        if found is not None:
            out.append({"figure": name, **found})
    return out


def _stages(data: RunData) -> list[dict[str, Any]]:
    """One row per pipeline stage (medians over its ranks), when there are stages."""
    steps = data.step_time or {}
    own = data.straggler.own_work_ms if data.straggler else None
    by_stage: dict[int, list[int]] = {}
    for rank, coordinates in data.layout.items():
        place = coordinates.get("pp")
        if place is not None and str(rank) in steps:
            by_stage.setdefault(place[0], []).append(rank)
    if len(by_stage) < 2:
        return []
    slow: set[int] = set()
    if data.straggler is not None:
        for cause in data.straggler.causes():
            slow.update(s.stage for s in cause.stages)
    out = []
    for stage, ranks in sorted(by_stage.items())[:MAX_STAGES]:
        p50 = sorted(steps[str(r)].p50_ms for r in ranks)
        work = sorted(own[str(r)] for r in ranks if own and str(r) in own)
        out.append(
            {
                "stage": stage,
                "ranks": len(ranks),
                "p50_ms": percentile(p50, 50.0),
                "own_work_ms": percentile(work, 50.0) if work else None,
                "slow": stage in slow,
            }
        )
    return out


GROUP_WORDS: Mapping[str, str] = {
    "node": "node",
    "pp": "pipeline stage",
    "dp": "data-parallel group",
}
"""What each grouping is called on the page, in the page's order."""


def _group_of(data: RunData, by: str) -> dict[int, int]:
    """rank -> its group's number in grouping ``by``."""
    if by == "node":
        return dict(data.rank_nodes)
    return {r: c[by][0] for r, c in data.layout.items() if by in c}


def _groups(
    data: RunData, p50: Mapping[int, float], named: Sequence[int], outliers: Sequence[int]
) -> list[dict[str, Any]]:
    """Each grouping of the ranks with at least two groups (:data:`GROUP_WORDS`): per
    group the distribution of its ranks' median step times (p50, p90, max over the
    ranks) and its slowest rank; the table's rows are the groups holding a named rank,
    then those holding an outlier of the rank table, then the slowest by p50,
    :data:`MAX_GROUP_ROWS` at most; the chart has every group up to
    :data:`MAX_GROUP_POINTS`."""
    out = []
    for by, word in GROUP_WORDS.items():
        group_of = _group_of(data, by)
        ranks = [r for r in data.ranks if r in p50 and r in group_of]
        if not ranks:
            continue
        of = np.array([group_of[r] for r in ranks], dtype=np.int64)
        ids, index, counts = np.unique(of, return_inverse=True, return_counts=True)
        if len(ids) < 2:
            continue
        order = np.argsort(index, kind="stable")
        members = np.array(ranks, dtype=np.int64)[order]
        grid = _grid(index[order], counts, np.array([p50[r] for r in ranks])[order])
        g50, g90 = _row_percentiles(grid, (50.0, 90.0))
        top = np.nanargmax(grid, axis=1)
        starts = np.zeros(len(ids), dtype=np.int64)
        starts[1:] = np.cumsum(counts)[:-1]
        slowest = members[starts + top]
        gmax = grid[np.arange(len(ids)), top]
        theirs: dict[int, list[int]] = {}
        for r in named:
            if r in group_of and r in p50:
                theirs.setdefault(group_of[r], []).append(r)
        p50s, p90s, maxes = _finite_list(g50), _finite_list(g90), _finite_list(gmax)
        g_list = ids.tolist()
        holding = {group_of[r] for r in outliers if r in group_of}

        keys = [
            (-len(theirs.get(g, ())), g not in holding, -(p50s[i] or 0.0), g)
            for i, g in enumerate(g_list)
        ]
        pick = sorted(range(len(g_list)), key=keys.__getitem__)[:MAX_GROUP_ROWS]
        rows = [
            {
                "group": g_list[i],
                "ranks": int(counts[i]),
                "p50_ms": p50s[i],
                "p90_ms": p90s[i],
                "max_ms": maxes[i],
                "slowest_rank": int(slowest[i]),
                "named": theirs.get(g_list[i], [])[:HIGHLIGHT],
                "named_count": len(theirs.get(g_list[i], ())),
            }
            for i in sorted(pick)
        ]
        out.append(
            {
                "by": by,
                "word": word,
                "count": len(g_list),
                "rows": rows,
                "rows_note": (
                    f"{len(rows)} of {len(g_list):,} {word}s: those with a named rank or "
                    "an outlier of the rank table, then the slowest p50"
                    if len(rows) < len(g_list)
                    else None
                ),
                "chart": (
                    {"group": g_list, "p50_ms": p50s, "p90_ms": p90s, "max_ms": maxes}
                    if len(g_list) <= MAX_GROUP_POINTS
                    else None
                ),
            }
        )
    return out


def _system(
    data: RunData, groups: Sequence[Mapping[str, Any]]
) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]], str | None]:
    """(the node rows of *Nodes and GPUs*, the distribution across nodes, a note): every
    node up to :data:`MAX_GROUP_ROWS` nodes; else the nodes of the node table."""
    if data.system is None:
        return None, [], None
    every = [dict(n) for n in data.system]
    if len(every) <= MAX_GROUP_ROWS:
        return every, [], None
    listed: set[int] = set()
    for group in groups:
        if group["by"] == "node":
            listed = {row["group"] for row in group["rows"]}
    rows = [n for n in every if n.get("node") in listed][:MAX_GROUP_ROWS]
    figures: dict[str, list[float]] = {
        "CPU %": [],
        "RAM used (bytes)": [],
        "GPU utilization %": [],
        "GPU memory used (bytes)": [],
    }
    for n in every:
        for name, key in (("CPU %", "cpu_percent"), ("RAM used (bytes)", "ram_used_bytes")):
            if isinstance(n.get(key), (int, float)):
                figures[name].append(float(n[key]))
        for g in n.get("gpus") or ():
            for name, key in (
                ("GPU utilization %", "utilization_percent"),
                ("GPU memory used (bytes)", "memory_used_bytes"),
            ):
                if isinstance(g.get(key), (int, float)):
                    figures[name].append(float(g[key]))
    spread = []
    for name, values in figures.items():
        found = _distribution(values)
        if found is not None:
            spread.append({"figure": name, **found})
    note = (
        f"{len(rows)} of {len(every):,} nodes: those of the node table; the distribution "
        "across every node above"
    )
    return rows, spread, note


def _ranges(ranks: Iterable[int]) -> list[list[int]]:
    """Ranks as [first, last] runs of consecutive ranks (the page checks *Show rank*
    against them; a short list however many ranks run)."""
    out: list[list[int]] = []
    for r in sorted(ranks):
        if out and r == out[-1][1] + 1:
            out[-1][1] = r
        else:
            out.append([r, r])
    return out


def files_command(folder: str) -> str:
    """``traceml dashboard FOLDER`` as a shell reads it (the folder quoted)."""
    return shlex.join(["traceml", "dashboard", folder])


def _limited(items: Sequence[Mapping[str, Any]] | None, keep: set[int] | None) -> Any:
    if items is None:
        return None
    if keep is None:
        return [dict(i) for i in items]
    return [dict(i) for i in items if i.get("rank") in keep]


def _p50s(data: RunData) -> dict[int, float]:
    """rank -> its median step time, for every rank with steps."""
    if data.rank_p50_ms is not None:
        return dict(data.rank_p50_ms)
    return {int(r): s.p50_ms for r, s in (data.step_time or {}).items() if s.steps}


def _step_series(data: RunData) -> StepSeries | Mapping[int, RankColumns]:
    """The run's steps as :func:`_series` takes them: the files' step columns as they
    are, anything else as flat columns."""
    series = data.series
    if isinstance(series, LazySeries):
        return series.get()
    if isinstance(series, StepSeries):
        return series
    if all(isinstance(c, RankColumns) for c in series.values()):
        return series  # type: ignore[return-value]
    return StepSeries.of(series)


def build_view(
    data: RunData, extra_ranks: Sequence[int] = (), *, charts: bool = True
) -> dict[str, Any]:
    """The page's JSON for ``data``; ``extra_ranks`` get their own step-time line.
    Without ``charts``, the lines over steps are left out (``step_time.deferred``):
    the page's first view, drawn before its charts can be."""
    ranks = list(data.ranks)
    stragglers = _straggler_ranks(data.straggler)
    p50 = _p50s(data)
    shown = outlier_ranks(ranks, stragglers, p50)
    keep: set[int] | None = None if len(shown) == len(ranks) else set(shown)
    if len(ranks) <= ALL_LINES_UP_TO:
        highlight = ranks
    else:
        slowest = heapq.nsmallest(HIGHLIGHT, ranks, key=lambda r: (-p50.get(r, 0.0), r))
        highlight = [*stragglers, *(r for r in slowest if r not in stragglers)][:HIGHLIGHT]
        highlight = sorted(set(highlight) | set(stragglers))
    if charts:
        series = _step_series(data)
        in_series = (
            set(series.ranks() if isinstance(series, StepSeries) else series)
            if extra_ranks
            else set()
        )
        extra = [r for r in extra_ranks if r in in_series]
        step_chart, throughput = _series(data, series, highlight, extra)
    else:
        step_chart = {"steps": [], "lines": [], "band": len(ranks) > ALL_LINES_UP_TO,
                      "deferred": True}  # fmt: skip
        throughput = {"steps": [], "steps_per_s": []}
    folded = _folded_phases(data, shown)
    groups = _groups(data, p50, stragglers, shown) if len(ranks) >= GROUPS_FROM else []
    system, system_spread, system_note = _system(data, groups)
    nodes = set(data.rank_nodes.values())
    job_rates = [s.steps_per_s for s in (data.step_time or {}).values() if s.steps]
    notes = list(data.notes)
    if data.source == "live" and not data.finished and data.memory == []:
        notes.append("peak memory: no step_memory line received yet")
    return {
        "version": VIEW_VERSION,
        "generated_unix_s": round(time.time(), 3),
        "source": data.source,
        "finished": data.finished,
        "status": data.status,
        "waiting": data.waiting,
        "identity": {
            "run_name": data.run_name,
            "run_folder": data.run_folder,
            "export_folder": data.export_folder,
            "host": data.host,
            "world_size": data.world_size,
            "ranks_reporting": len(ranks),
            "node_count": len(nodes),
            "strategy": data.strategy,
            "files_command": files_command(data.run_folder) if data.run_folder else None,
        },
        "window": data.window,
        "straggler": {
            "line": _verdict(data, ranks),
            "verdict": data.straggler.verdict if data.straggler else None,
            "ranks": stragglers[:MAX_TABLE_ROWS],
            "ranks_count": len(stragglers),
            "definition": data.straggler.definition if data.straggler else None,
            "cost": cost_line(data.straggler) if ranks else None,
        },
        "spread": _spread(data, p50),
        "stages": _stages(data),
        "groups": groups,
        "ranks": _rank_table(data, shown, folded),
        "ranks_total": len(ranks),
        "rank_ranges": _ranges(ranks),
        "max_extra_ranks": MAX_EXTRA_RANKS,
        "ranks_shown_note": (
            f"{len(shown)} of {len(ranks):,} ranks: the named stragglers, then the slowest p50"
            if len(shown) < len(ranks)
            else None
        ),
        "step_time": step_chart,
        "throughput": {
            **throughput,
            "job_steps_per_s": _finite(min(job_rates)) if job_rates else None,
        },
        "phases": _phase_chart(folded, shown),
        "memory": _limited(data.memory, keep),
        "memory_basis": data.memory_basis,
        "process": _limited(data.process, keep),
        "process_basis": data.process_basis,
        "system": system,
        "system_spread": system_spread,
        "system_note": system_note,
        "system_basis": data.system_basis,
        "loss": dict(data.loss),
        "notes": notes,
        "problems": list(data.problems),
    }
