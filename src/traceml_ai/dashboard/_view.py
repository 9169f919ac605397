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
(``extra_ranks``). Long runs are binned to at most :data:`MAX_POINTS` points.
"""

from __future__ import annotations

import math
import shlex
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

import attrs
import numpy as np

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
    "HIGHLIGHT",
    "MAX_EXTRA_RANKS",
    "MAX_POINTS",
    "MAX_STAGES",
    "MAX_TABLE_ROWS",
    "PHASE_COLOURS",
    "USER_PHASE_COLOURS",
    "VIEW_VERSION",
    "RunData",
    "build_view",
    "files_command",
]

VIEW_VERSION = 1
MAX_POINTS = 600
"""Points per line at most: longer runs are binned (each point the mean of its bin)."""
ALL_LINES_UP_TO = 8
"""Up to this many ranks, every rank has its own line; above, median and band."""
HIGHLIGHT = 5
"""Ranks drawn as their own line above ALL_LINES_UP_TO: the stragglers, then the slowest."""
MAX_TABLE_ROWS = 8
"""Rows of the per-rank tables: the named ranks, then the slowest p50 (every rank of a
job this small); the distribution across ranks and the stages stand for the rest."""
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
"""rank -> its steps: (step, step ms, end ns) tuples (the live window), or the files'
step columns as they are (a big run's million steps are binned by numpy)."""
"""rank -> its steps in step order: (step, step time in ms, end of the step in ns)."""


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
    series: Series = attrs.field(factory=dict)
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


def _bins(steps: Sequence[int]) -> int:
    return max(1, math.ceil(len(steps) / MAX_POINTS))


def _x(steps: Sequence[int], size: int) -> list[int]:
    """The x of each bin: its last step."""
    return [steps[min(i + size, len(steps)) - 1] for i in range(0, len(steps), size)]


def _straggler_ranks(view: StragglerView | None) -> list[int]:
    return view.named_ranks if view is not None else []


def _slowest(ranks: Iterable[int], step_time: Mapping[str, RankSteps] | None) -> list[int]:
    """Ranks, slowest p50 first."""
    if not step_time:
        return sorted(ranks)

    def p50(r: int) -> float:
        s = step_time.get(str(r))
        return s.p50_ms if s is not None else 0.0

    return sorted(ranks, key=lambda r: (-p50(r), r))


# --------------------------------------------------------------------------- sections


def _rank_bins(
    steps: Sequence[tuple[int, float, float]], index: Mapping[int, int], n: int
) -> tuple[list[float | None], list[float | None]]:
    """One rank's (step ms, ms since the previous step's end) per bin: bin means."""
    sums, counts = [0.0] * n, [0] * n
    gap_sums, gap_counts = [0.0] * n, [0] * n
    before_step, before_ts = -1, 0.0
    for s, ms, ts in steps:
        i = index[s]
        sums[i] += ms
        counts[i] += 1
        if before_step == s - 1:
            gap = (ts - before_ts) / 1e6
            if gap > 0:
                gap_sums[i] += gap
                gap_counts[i] += 1
        before_step, before_ts = s, ts
    return (
        [sums[i] / counts[i] if counts[i] else None for i in range(n)],
        [gap_sums[i] / gap_counts[i] if gap_counts[i] else None for i in range(n)],
    )


def _column_bins(
    c: RankColumns, all_steps: Sequence[int], size: int, n: int
) -> tuple[list[float | None], list[float | None]]:
    """:func:`_rank_bins` of one rank's step columns, by numpy (the same sums, in the
    same order)."""
    bins = np.searchsorted(np.asarray(all_steps), c.steps) // size
    sums = np.bincount(bins, weights=c.step_ms, minlength=n)
    counts = np.bincount(bins, minlength=n)
    ts = c.ends()
    follows = np.zeros(len(c), dtype=np.bool_)
    follows[1:] = c.steps[1:] == c.steps[:-1] + 1
    gap = np.zeros(len(c), dtype=np.float64)
    gap[1:] = (ts[1:] - ts[:-1]) / 1e6
    counted = follows & (gap > 0)
    gap_sums = np.bincount(bins[counted], weights=gap[counted], minlength=n)
    gap_counts = np.bincount(bins[counted], minlength=n)
    return (
        [float(a) / int(b) if b else None for a, b in zip(sums, counts, strict=True)],
        [float(a) / int(b) if b else None for a, b in zip(gap_sums, gap_counts, strict=True)],
    )


def _series(
    data: RunData, highlight: Sequence[int], extra: Sequence[int]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(step time over steps, throughput over steps).

    One pass over every rank's rows; per bin of steps, the median and 10th/90th
    percentiles over ranks of each rank's mean step time in the bin, and the job's
    steps per second: 1000 over the median (over ranks) time between step ends."""
    rows = data.series
    columns = {r: c for r, c in rows.items() if isinstance(c, RankColumns)}
    if columns:
        all_steps = np.unique(np.concatenate([c.steps for c in columns.values()])).tolist()
    else:
        all_steps = sorted({t[0] for steps in rows.values() for t in steps})  # type: ignore[union-attr]
    if not all_steps:
        return {"steps": [], "lines": []}, {"steps": [], "steps_per_s": []}
    size = _bins(all_steps)
    n = math.ceil(len(all_steps) / size)
    index = {} if columns else {s: i // size for i, s in enumerate(all_steps)}
    by_bin: list[list[float]] = [[] for _ in range(n)]
    gaps_by_bin: list[list[float]] = [[] for _ in range(n)]
    wanted = set(highlight) | set(extra)
    lines_of: dict[int, list[float | None]] = {}
    for r, steps in rows.items():
        if isinstance(steps, RankColumns):
            values, gaps = _column_bins(steps, all_steps, size, n)
        else:
            values, gaps = _rank_bins(steps, index, n)
        for i in range(n):
            v, g = values[i], gaps[i]
            if v is not None:
                by_bin[i].append(v)
            if g is not None:
                gaps_by_bin[i].append(g)
        if r in wanted:
            lines_of[r] = [_finite(v) for v in values]
    median: list[float | None] = []
    low: list[float | None] = []
    high: list[float | None] = []
    rate: list[float | None] = []
    for i in range(n):
        ms = sorted(by_bin[i])
        if ms:
            median.append(_finite(percentile(ms, 50.0)))
            low.append(_finite(percentile(ms, 10.0)))
            high.append(_finite(percentile(ms, 90.0)))
        else:
            median.append(None)
            low.append(None)
            high.append(None)
        between = sorted(gaps_by_bin[i])
        mid = percentile(between, 50.0) if between else 0.0
        rate.append(_finite(1000.0 / mid) if mid > 0 else None)
    stragglers = set(_straggler_ranks(data.straggler))
    lines = [
        {
            "rank": r,
            "values": lines_of[r],
            "straggler": r in stragglers,
            "on_demand": r not in highlight,
        }
        for r in [*highlight, *(r for r in extra if r not in highlight)]
        if r in lines_of
    ]
    x = _x(all_steps, size)
    step_chart = {
        "steps": x,
        "bin": size,
        "median": median,
        "p10": low,
        "p90": high,
        "lines": lines,
        "band": len(rows) > ALL_LINES_UP_TO,
    }
    return step_chart, {"steps": x, "bin": size, "steps_per_s": rate}


def _verdict(data: RunData, ranks: Sequence[int]) -> str:
    if not ranks:
        return "straggler: no step times yet"
    if data.straggler is None:
        return "straggler: not analysed yet (the analysis runs every few seconds)"
    return verdict_line(data.straggler)


Folded = tuple[list[str], dict[str, dict[str, tuple[float, float]]]]
"""(the phases the page draws, in order; rank (str) -> phase -> (mean ms, share))."""


def _folded_phases(data: RunData) -> Folded:
    """The phases as the page draws them: folded by the live views' one rule
    (:class:`~traceml_ai.analysis.UserPhaseFold`), so that the page from files keeps
    the phases the live page kept and ``other`` holds the rest, summed: each rank's bars
    still add up to its iteration."""
    fold = UserPhaseFold()
    label = {name: fold(name) for name in data.phase_names}
    names = list(dict.fromkeys(label.values()))
    per_rank: dict[str, dict[str, tuple[float, float]]] = {}
    for rank, figures in (data.phases or {}).items():
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


def _spread(data: RunData) -> list[dict[str, Any]]:
    """The figures across ranks, each as its distribution (the rows of *Across ranks*)."""
    steps = list((data.step_time or {}).values())
    if not steps:
        return []
    rows = [
        ("step time p50 (ms)", [s.p50_ms for s in steps]),
        ("step time p99 (ms)", [s.p99_ms for s in steps]),
        ("steps/s", [s.steps_per_s for s in steps]),
    ]
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


def build_view(data: RunData, extra_ranks: Sequence[int] = ()) -> dict[str, Any]:
    """The page's JSON for ``data``; ``extra_ranks`` get their own step-time line."""
    ranks = list(data.ranks)
    stragglers = _straggler_ranks(data.straggler)
    slowest = _slowest(ranks, data.step_time)
    if len(ranks) <= ALL_LINES_UP_TO:
        highlight = ranks
    else:
        highlight = [*stragglers, *(r for r in slowest if r not in stragglers)][:HIGHLIGHT]
        highlight = sorted(set(highlight) | set(stragglers))
    if len(ranks) <= MAX_TABLE_ROWS:
        shown = ranks
        keep: set[int] | None = None
    else:
        order = [*stragglers, *(r for r in slowest if r not in stragglers)]
        shown = sorted(order[:MAX_TABLE_ROWS])
        keep = set(shown)
    extra = [r for r in extra_ranks if r in data.series]
    step_chart, throughput = _series(data, highlight, extra)
    folded = _folded_phases(data)
    nodes = sorted(set(data.rank_nodes.values()))
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
            "nodes": nodes,
            "strategy": data.strategy,
            "files_command": files_command(data.run_folder) if data.run_folder else None,
        },
        "window": data.window,
        "straggler": {
            "line": _verdict(data, ranks),
            "verdict": data.straggler.verdict if data.straggler else None,
            "ranks": stragglers,
            "definition": data.straggler.definition if data.straggler else None,
            "cost": cost_line(data.straggler) if ranks else None,
        },
        "spread": _spread(data),
        "stages": _stages(data),
        "ranks": _rank_table(data, shown, folded),
        "ranks_total": len(ranks),
        "rank_ranges": _ranges(ranks),
        "max_extra_ranks": MAX_EXTRA_RANKS,
        "ranks_shown_note": (
            f"{len(shown)} of {len(ranks)} ranks: the stragglers, then the slowest p50"
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
        "system": [dict(n) for n in data.system] if data.system is not None else None,
        "system_basis": data.system_basis,
        "loss": dict(data.loss),
        "notes": notes,
        "problems": list(data.problems),
    }
