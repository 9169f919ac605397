"""The live metrics: defined once here, served by Prometheus and OTLP alike.

:data:`METRICS` is the one list of every metric the aggregator publishes: its
Prometheus name, kind, unit, labels and meaning. :func:`collect` reads a
:class:`~traceml_ai.monitor._state.LiveState` and the aggregator's own health into
:class:`Family` values, which the Prometheus endpoint writes as its exposition and
the OTLP exporter as OTLP data points; ``docs/monitoring.md``'s metric and series
tables are :func:`metrics_table_markdown` and :func:`series_table_markdown` (a test
keeps the page in step).

Names follow Prometheus' conventions: base units (seconds, bytes, ratios), counters
end in ``_total``. OTLP takes the same name without ``_total`` (:func:`otlp_name`),
with the unit in the data (UCUM: ``s``, ``By``, ``1`` for ratios, ``{step}``-style
annotations for counts, which OTLP-to-Prometheus translation leaves out of the name),
so that a backend that converts OTLP to Prometheus names arrives at the same series.

Series are bounded at any rank count. The step and phase histograms are the job's
(every rank's steps in one), and every run has the distribution across ranks of each
rank's figures (:data:`RANK_DISTRIBUTIONS`: min, p50, p90 and max as a ``stat``
label), across nodes and GPUs of the system figures (:data:`NODE_DISTRIBUTIONS`), each
node's and each pipeline stage's median step time, and the straggler analysis. Each
rank's own series (its gauges and histograms, per node its system and GPU figures) are
served for every rank while the run has at most ``rank_series_max_ranks`` ranks (64 by
default); above it, the per-rank gauges only for the :data:`TOP_K` slowest ranks and
at most :data:`MAX_NAMED` ranks the straggler analysis names, no rank's histograms, and
no per-node system series. Per-node and per-stage series are capped too
(:data:`MAX_NODE_SERIES`, :data:`MAX_STAGE_SERIES`: the slowest are kept). Phases are
the five built-in ones plus at most ``MAX_USER_PHASES`` user names (the rest are
``other``), devices at most 16 per rank, GPUs at most 64 per node.
:func:`series_estimate` gives the count for a run's shape.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import attrs

from traceml_ai.analysis import BUILT_IN_PHASES, Coordinates, StragglerView, percentile
from traceml_ai.monitor._state import (
    GPU_COLUMNS,
    MAX_USER_PHASES,
    PHASE_BUCKETS_S,
    PROCESS_COLUMNS,
    STEP_BUCKETS_S,
    SYSTEM_COLUMNS,
    WINDOW_STEPS,
    Histogram,
    LiveState,
    MetricFigures,
    NodeLive,
    RankFigures,
)
from traceml_ai.settings import RANK_SERIES_MAX_RANKS

if TYPE_CHECKING:
    from numpy.typing import NDArray

__all__ = [
    "MAX_NAMED",
    "MAX_NODE_SERIES",
    "MAX_STAGE_SERIES",
    "METRICS",
    "NODE_DISTRIBUTIONS",
    "QUANTILES",
    "RANK_DISTRIBUTIONS",
    "RANK_HISTOGRAMS",
    "TOP_K",
    "Family",
    "Health",
    "MetricDef",
    "Sample",
    "collect",
    "metrics_table_markdown",
    "otlp_name",
    "series_estimate",
    "series_table_markdown",
    "traceml_version",
]

Kind = Literal["counter", "gauge", "histogram"]


@attrs.frozen
class MetricDef:
    """One metric: its Prometheus name, kind, OTLP/UCUM unit, labels, meaning and source."""

    name: str
    kind: Kind
    unit: str
    labels: tuple[str, ...]
    help: str
    source: str
    """Where its figures come from (a stream, or the aggregator itself), for the docs."""


def _m(
    name: str, kind: Kind, unit: str, labels: tuple[str, ...], help: str, source: str
) -> MetricDef:
    return MetricDef(name, kind, unit, labels, help, source)


_PHASES_HELP = (
    "dataloader_wait, h2d, forward, backward, optimizer, "
    f"user:NAME (at most {MAX_USER_PHASES} names per run; later ones count as other)"
)
TOP_K = 8
"""Above ``rank_series_max_ranks`` ranks, the slowest ranks (by their median step time)
whose gauges are served."""
MAX_NAMED = 16
"""Above ``rank_series_max_ranks`` ranks, the most ranks the straggler analysis names
whose series are served (those with the largest excess)."""
MAX_NODE_SERIES = 1280
"""Nodes with a step time series (the slowest when there are more): every node of a
10,240-rank job of 8-rank nodes."""
MAX_STAGE_SERIES = 32
"""Pipeline stages with a series of their own (the slowest when there are more), as the
trackers' ``traceml/stage/<stage>/step_time_ms``."""
QUANTILES: tuple[tuple[str, float], ...] = (
    ("min", 0.0),
    ("p50", 50.0),
    ("p90", 90.0),
    ("max", 100.0),
)
"""The distributions' ``stat`` label values and their percentiles (linear
interpolation between the closest values, numpy's default). Not Prometheus'
``quantile`` label, which is for summaries only."""

_RANK_DETAIL = "Served while the run has at most --rank-series-max-ranks ranks."
_RANK_SOME = (
    "Every rank while the run has at most --rank-series-max-ranks ranks; above, the "
    f"{TOP_K} slowest and the ranks the straggler analysis names."
)
_NODE_SOME = "Served while the run has at most --rank-series-max-ranks ranks."

RUN_INFO = _m(
    "traceml_run_info", "gauge", "1", ("run", "version"),
    "Always 1: the run's name (its folder) and TraceML's version, as labels.", "aggregator",
)  # fmt: skip
JOB_STEP_TIME = _m(
    "traceml_job_step_time_seconds", "histogram", "s", (),
    "Duration of each traced step, every rank's steps in one histogram.", "step_time",
)  # fmt: skip
JOB_PHASE_TIME = _m(
    "traceml_job_phase_time_seconds", "histogram", "s", ("phase",),
    f"Time of each phase in each step, every rank's steps in one histogram per phase: "
    f"{_PHASES_HELP}.",
    "step_time",
)  # fmt: skip
RANK_STEP_TIME = _m(
    "traceml_rank_step_time_median_seconds", "gauge", "s", ("rank", "node"),
    f"Median duration of the rank's recent steps (its last {WINDOW_STEPS}). {_RANK_SOME}", "step_time",
)  # fmt: skip
STEP_TIME = _m(
    "traceml_step_time_seconds", "histogram", "s", ("rank", "node"),
    f"Duration of each traced step of the rank (the whole step). {_RANK_DETAIL}", "step_time",
)  # fmt: skip
PHASE_TIME = _m(
    "traceml_phase_time_seconds", "histogram", "s", ("rank", "phase"),
    f"Time of each phase in each step of the rank: {_PHASES_HELP}. {_RANK_DETAIL}",
    "step_time",
)  # fmt: skip
STEPS = _m(
    "traceml_steps_total",
    "counter",
    "{step}",
    ("rank",),
    f"Steps received. {_RANK_SOME}",
    "step_time",
)
LAST_STEP = _m("traceml_last_step", "gauge", "{step}", ("rank",), f"The rank's latest step number. {_RANK_SOME}", "step_time")  # fmt: skip
LAST_STEP_TIME = _m(
    "traceml_last_step_timestamp_seconds", "gauge", "s", ("rank",),
    f"When the rank's latest step ended (Unix time). {_RANK_SOME}", "step_time",
)  # fmt: skip
PEAK_ALLOCATED = _m(
    "traceml_step_peak_allocated_bytes", "gauge", "By", ("rank", "device"),
    f"Peak tensor memory allocated during the rank's latest step on the device. "
    f"{_RANK_SOME}", "step_memory",
)  # fmt: skip
PEAK_RESERVED = _m(
    "traceml_step_peak_reserved_bytes", "gauge", "By", ("rank", "device"),
    f"Peak memory reserved by the caching allocator during the latest step. {_RANK_SOME}", "step_memory",
)  # fmt: skip
PROCESS_CPU = _m(
    "traceml_process_cpu_cores", "gauge", "{core}", ("rank",),
    f"CPU the training process uses, in cores (1.5 = one and a half cores). {_RANK_SOME}", "process",
)  # fmt: skip
PROCESS_RSS = _m(
    "traceml_process_resident_memory_bytes", "gauge", "By", ("rank",),
    f"Resident memory of the training process. {_RANK_SOME}", "process",
)  # fmt: skip
PROCESS_GPU_USED = _m(
    "traceml_process_gpu_memory_used_bytes", "gauge", "By", ("rank",),
    f"GPU memory the rank's process has allocated on its GPU. {_RANK_SOME}", "process",
)  # fmt: skip
PROCESS_GPU_RESERVED = _m(
    "traceml_process_gpu_memory_reserved_bytes", "gauge", "By", ("rank",),
    f"GPU memory the rank's allocator has reserved on its GPU. {_RANK_SOME}", "process",
)  # fmt: skip
SYSTEM_CPU = _m(
    "traceml_system_cpu_ratio", "gauge", "1", ("node",),
    f"Host-wide CPU use, 0 to 1. {_NODE_SOME}", "system",
)  # fmt: skip
SYSTEM_RAM_USED = _m("traceml_system_memory_used_bytes", "gauge", "By", ("node",), f"Host RAM in use. {_NODE_SOME}", "system")  # fmt: skip
SYSTEM_RAM_TOTAL = _m("traceml_system_memory_total_bytes", "gauge", "By", ("node",), f"Host RAM. {_NODE_SOME}", "system")  # fmt: skip
GPU_UTIL = _m("traceml_gpu_utilization_ratio", "gauge", "1", ("node", "gpu"), f"GPU utilisation, 0 to 1. {_NODE_SOME}", "system")  # fmt: skip
GPU_MEM_USED = _m("traceml_gpu_memory_used_bytes", "gauge", "By", ("node", "gpu"), f"GPU memory in use. {_NODE_SOME}", "system")  # fmt: skip
GPU_MEM_TOTAL = _m("traceml_gpu_memory_total_bytes", "gauge", "By", ("node", "gpu"), f"GPU memory. {_NODE_SOME}", "system")  # fmt: skip
GPU_TEMP = _m("traceml_gpu_temperature_celsius", "gauge", "Cel", ("node", "gpu"), f"GPU temperature. {_NODE_SOME}", "system")  # fmt: skip
GPU_POWER = _m("traceml_gpu_power_watts", "gauge", "W", ("node", "gpu"), f"GPU power draw. {_NODE_SOME}", "system")  # fmt: skip
GPU_POWER_LIMIT = _m("traceml_gpu_power_limit_watts", "gauge", "W", ("node", "gpu"), f"GPU power limit. {_NODE_SOME}", "system")  # fmt: skip
STRAGGLERS = _m(
    "traceml_stragglers", "gauge", "{rank}", ("verdict",),
    "Ranks the straggler analysis names now (over each rank's recent steps), with its "
    "verdict as a label: straggler, intermittent, slow_stage, data_imbalance, none or "
    "n/a (one series; a slow stage's or an imbalance's ranks are not counted).",
    "step_time",
)  # fmt: skip
SLOWDOWN = _m(
    "traceml_slowdown_ratio", "gauge", "1", ("cause",),
    "For each cause the analysis finds now (straggler, intermittent, slow_stage, "
    "data_imbalance): the measured step time over the step time without it (replayed).",
    "step_time",
)  # fmt: skip
SLOW_STAGE_EXCESS = _m(
    "traceml_slow_stage_excess_seconds", "gauge", "s", ("stage",),
    "For each pipeline stage the analysis finds slow now: its own work per iteration "
    "beyond the other stages' (the least over the replicas).",
    "step_time",
)  # fmt: skip
IMBALANCE_SPREAD = _m(
    "traceml_data_imbalance_spread_seconds", "gauge", "s", (),
    "With a data imbalance found now: per step, the slowest replica's extra work over "
    "the fastest's (median).",
    "step_time",
)  # fmt: skip
STRAGGLER_EXCESS = _m(
    "traceml_straggler_excess_seconds", "gauge", "s", ("rank", "phase"),
    "For each rank the analysis names now: its own work per iteration beyond the others' "
    "(in its slow steps when intermittent), and the phase where the extra sits.",
    "step_time",
)  # fmt: skip
EXPORT_RECORDS = _m(
    "traceml_export_records_total", "counter", "{record}", ("stream",),
    "Records the exporter wrote, per stream (export on).", "aggregator",
)  # fmt: skip
EXPORT_FAILED = _m(
    "traceml_export_failed_records_total", "counter", "{record}", ("stream",),
    "Records built but not written (the exporter failed), per stream.", "aggregator",
)  # fmt: skip
EXPORT_DROPPED = _m(
    "traceml_export_dropped_batches_total", "counter", "{batch}", (),
    "Batches lost before export: the aggregator's full queue, and what the ranks "
    "reported dropping.", "aggregator",
)  # fmt: skip
REJECTED_CONNECTIONS = _m(
    "traceml_rejected_connections_total", "counter", "{connection}", (),
    "Connections the aggregator refused (wrong token, limits).", "aggregator",
)  # fmt: skip
RANKS_EXPECTED = _m("traceml_ranks_expected", "gauge", "{rank}", (), "Ranks the run should have.", "aggregator")  # fmt: skip
RANKS_REPORTING = _m("traceml_ranks_reporting", "gauge", "{rank}", (), "Ranks heard from so far.", "aggregator")  # fmt: skip
RANKS_FINISHED = _m("traceml_ranks_finished", "gauge", "{rank}", (), "Ranks that finished cleanly.", "aggregator")  # fmt: skip
RANKS_MISSING = _m(
    "traceml_ranks_missing", "gauge", "{rank}", (),
    "Expected ranks not heard from yet, or gone without finishing.", "aggregator",
)  # fmt: skip
LIVE_DROPPED = _m(
    "traceml_live_dropped_batches_total", "counter", "{batch}", (),
    "Batches the live views skipped because their queue was full (the files are unaffected).",
    "aggregator",
)  # fmt: skip

NODE_STEP_TIME = _m(
    "traceml_node_step_time_median_seconds", "gauge", "s", ("node",),
    "Median over the node's ranks of their median step time (their recent steps); at "
    f"most {MAX_NODE_SERIES:,} nodes (the slowest).",
    "step_time",
)  # fmt: skip
STAGE_STEP_TIME = _m(
    "traceml_stage_step_time_median_seconds", "gauge", "s", ("stage",),
    "Median over a pipeline stage's ranks of their median step time, when the ranks "
    f"said their place in the layout and it has several stages; at most "
    f"{MAX_STAGE_SERIES} stages (the slowest).",
    "step_time",
)  # fmt: skip


def _across(name: str, of: MetricDef, over: str) -> MetricDef:
    """The distribution of ``of``'s values across ``over``: one gauge per :data:`QUANTILES`."""
    return MetricDef(
        name,
        "gauge",
        of.unit,
        ("stat",),
        f"`{of.name}` across {over}, with the label `stat`: min, p50, p90 or max.",
        of.source,
    )


RANK_DISTRIBUTIONS: tuple[tuple[MetricDef, MetricDef], ...] = tuple(
    (_across(name, of, "every rank (every device of every rank for memory)"), of)
    for name, of in (
        ("traceml_ranks_step_time_median_seconds", RANK_STEP_TIME),
        ("traceml_ranks_steps", STEPS),
        ("traceml_ranks_last_step", LAST_STEP),
        ("traceml_ranks_last_step_timestamp_seconds", LAST_STEP_TIME),
        ("traceml_ranks_step_peak_allocated_bytes", PEAK_ALLOCATED),
        ("traceml_ranks_step_peak_reserved_bytes", PEAK_RESERVED),
        ("traceml_ranks_process_cpu_cores", PROCESS_CPU),
        ("traceml_ranks_process_resident_memory_bytes", PROCESS_RSS),
        ("traceml_ranks_process_gpu_memory_used_bytes", PROCESS_GPU_USED),
        ("traceml_ranks_process_gpu_memory_reserved_bytes", PROCESS_GPU_RESERVED),
    )
)
"""(distribution, the per-rank metric it is of): served at any rank count."""
NODE_DISTRIBUTIONS: tuple[tuple[MetricDef, MetricDef], ...] = tuple(
    (_across(name, of, over), of)
    for name, of, over in (
        ("traceml_nodes_system_cpu_ratio", SYSTEM_CPU, "every node"),
        ("traceml_nodes_system_memory_used_bytes", SYSTEM_RAM_USED, "every node"),
        ("traceml_nodes_system_memory_total_bytes", SYSTEM_RAM_TOTAL, "every node"),
        ("traceml_gpus_utilization_ratio", GPU_UTIL, "every GPU of every node"),
        ("traceml_gpus_memory_used_bytes", GPU_MEM_USED, "every GPU of every node"),
        ("traceml_gpus_memory_total_bytes", GPU_MEM_TOTAL, "every GPU of every node"),
        ("traceml_gpus_temperature_celsius", GPU_TEMP, "every GPU of every node"),
        ("traceml_gpus_power_watts", GPU_POWER, "every GPU of every node"),
        ("traceml_gpus_power_limit_watts", GPU_POWER_LIMIT, "every GPU of every node"),
    )
)
"""(distribution, the per-node or per-GPU metric it is of): served at any rank count."""

METRICS: tuple[MetricDef, ...] = (
    RUN_INFO, JOB_STEP_TIME, JOB_PHASE_TIME, RANK_STEP_TIME, NODE_STEP_TIME, STAGE_STEP_TIME,
    STEP_TIME, PHASE_TIME, STEPS, LAST_STEP, LAST_STEP_TIME, PEAK_ALLOCATED, PEAK_RESERVED,
    PROCESS_CPU, PROCESS_RSS, PROCESS_GPU_USED, PROCESS_GPU_RESERVED,
    SYSTEM_CPU, SYSTEM_RAM_USED, SYSTEM_RAM_TOTAL,
    GPU_UTIL, GPU_MEM_USED, GPU_MEM_TOTAL, GPU_TEMP, GPU_POWER, GPU_POWER_LIMIT,
    *(d for d, _ in RANK_DISTRIBUTIONS), *(d for d, _ in NODE_DISTRIBUTIONS),
    STRAGGLERS, STRAGGLER_EXCESS, SLOWDOWN, SLOW_STAGE_EXCESS, IMBALANCE_SPREAD,
    EXPORT_RECORDS, EXPORT_FAILED, EXPORT_DROPPED, REJECTED_CONNECTIONS,
    RANKS_EXPECTED, RANKS_REPORTING, RANKS_FINISHED, RANKS_MISSING, LIVE_DROPPED,
)  # fmt: skip
"""Every metric, in the order of the docs' table."""

RANK_HISTOGRAMS: tuple[MetricDef, ...] = (STEP_TIME, PHASE_TIME)
"""Each rank's own histograms: served only while the run has at most
``rank_series_max_ranks`` ranks (most of the series otherwise)."""

BUCKETS: Mapping[str, tuple[float, ...]] = {
    JOB_STEP_TIME.name: STEP_BUCKETS_S,
    JOB_PHASE_TIME.name: PHASE_BUCKETS_S,
    STEP_TIME.name: STEP_BUCKETS_S,
    PHASE_TIME.name: PHASE_BUCKETS_S,
}
"""Histogram bucket upper bounds (seconds; +Inf after the last)."""

# Series of one rank, one device of a rank and one node, by what they are per (what
# series_estimate counts; the histograms are counted from their buckets).
_PER_RANK: tuple[MetricDef, ...] = (
    RANK_STEP_TIME, STEPS, LAST_STEP, LAST_STEP_TIME,
    PROCESS_CPU, PROCESS_RSS, PROCESS_GPU_USED, PROCESS_GPU_RESERVED,
)  # fmt: skip
_PER_DEVICE: tuple[MetricDef, ...] = (PEAK_ALLOCATED, PEAK_RESERVED)
_PER_NODE: tuple[MetricDef, ...] = (SYSTEM_CPU, SYSTEM_RAM_USED, SYSTEM_RAM_TOTAL)
_PER_GPU: tuple[MetricDef, ...] = (
    GPU_UTIL, GPU_MEM_USED, GPU_MEM_TOTAL, GPU_TEMP, GPU_POWER, GPU_POWER_LIMIT,
)  # fmt: skip


@attrs.frozen
class Health:
    """The aggregator's own figures at one moment."""

    written_records: Mapping[str, int] = attrs.field(factory=dict)
    failed_records: Mapping[str, int] = attrs.field(factory=dict)
    dropped_batches: int = 0
    rejected_connections: int = 0
    expected_ranks: int | None = None
    reporting_ranks: int = 0
    finished_ranks: int = 0
    missing_ranks: int = 0
    live_dropped_batches: int = 0


class Sample(NamedTuple):
    """One series' value: ``value`` for counters and gauges, ``histogram`` for histograms.

    A named tuple: a scrape of a large run makes tens of thousands."""

    labels: tuple[str, ...]
    value: float = 0.0
    histogram: Histogram | None = None


@attrs.frozen
class Family:
    """One metric's series at one moment."""

    metric: MetricDef
    samples: list[Sample]


def otlp_name(metric: MetricDef) -> str:
    """The metric's OTLP name: the Prometheus name without ``_total``."""
    return metric.name.removesuffix("_total")


def traceml_version() -> str:
    """TraceML's version (``traceml_ai.__version__``: one source for every view)."""
    import traceml_ai

    return str(traceml_ai.__version__)


def collect(
    state: LiveState, health: Health, *, run_name: str, rank_series_max_ranks: int
) -> list[Family]:
    """Every metric's series now, in :data:`METRICS` order (empty families included).

    Each rank's own series, and each node's system and GPU series, only while the run
    has at most ``rank_series_max_ranks`` ranks; above it, the gauges of the
    :data:`TOP_K` slowest ranks and of at most :data:`MAX_NAMED` named stragglers. The
    distributions, the per-node and per-stage step times and the job's histograms are
    served at any rank count."""
    out: dict[str, list[Sample]] = {m.name: [] for m in METRICS}

    def add(metric: MetricDef, labels: tuple[str, ...], value: float) -> None:
        out[metric.name].append(Sample(labels, value))

    add(RUN_INFO, (run_name, traceml_version()), 1)
    figures = state.metric_figures(rank_series_max_ranks)
    every_rank = figures.rank_count <= rank_series_max_ranks
    out[JOB_STEP_TIME.name].append(Sample((), histogram=figures.job_step))
    for phase, hist in figures.job_phases.items():
        out[JOB_PHASE_TIME.name].append(Sample((phase,), histogram=hist))
    view = state.straggler
    verdict, named = _straggler_figures(view)
    if not every_rank and len(named) > MAX_NAMED:
        named = heapq.nlargest(MAX_NAMED, named, key=lambda n: n[2])
    shown = figures.rank_figures(
        None if every_rank else _slowest_and_named(figures, {n[0] for n in named})
    )
    _rank_series(out, shown)
    _rank_distributions(out, figures)
    _group_step_times(out, figures, state.layout())
    if every_rank:
        _node_series(out, state.node_figures())
    else:
        _node_distributions(out, *state.node_tables())
    add(STRAGGLERS, (verdict,), len(named))
    for slow_rank, phase, excess_ms in named:
        add(STRAGGLER_EXCESS, (str(slow_rank), phase), excess_ms / 1000.0)
    stages: list[tuple[int, float]] = []
    for cause in view.causes() if view is not None else ():
        if cause.slowdown is not None:
            add(SLOWDOWN, (cause.verdict,), cause.slowdown.factor)
        stages.extend((stage.stage, stage.excess_ms) for stage in cause.stages)
        if cause.imbalance is not None:
            add(IMBALANCE_SPREAD, (), cause.imbalance.spread_ms / 1000.0)
    if not every_rank and len(stages) > MAX_STAGE_SERIES:
        stages = heapq.nlargest(MAX_STAGE_SERIES, stages, key=lambda s: s[1])
    for stage_no, excess_ms in stages:
        add(SLOW_STAGE_EXCESS, (str(stage_no),), excess_ms / 1000.0)
    for stream, n_written in sorted(health.written_records.items()):
        add(EXPORT_RECORDS, (stream,), n_written)
    for stream, n_failed in sorted(health.failed_records.items()):
        add(EXPORT_FAILED, (stream,), n_failed)
    add(EXPORT_DROPPED, (), health.dropped_batches)
    add(REJECTED_CONNECTIONS, (), health.rejected_connections)
    if health.expected_ranks is not None:
        add(RANKS_EXPECTED, (), health.expected_ranks)
    add(RANKS_REPORTING, (), health.reporting_ranks)
    add(RANKS_FINISHED, (), health.finished_ranks)
    add(RANKS_MISSING, (), health.missing_ranks)
    add(LIVE_DROPPED, (), health.live_dropped_batches)
    return [Family(m, out[m.name]) for m in METRICS]


def _slowest_and_named(figures: MetricFigures, named: set[int]) -> list[int]:
    """The positions of the :data:`TOP_K` ranks with the longest median step time (the
    lower rank first on a tie) and of the ``named`` ones, in rank order."""
    timed = [
        (ms, -rank, i)
        for i, (ms, rank) in enumerate(zip(figures.recent_median_ms, figures.rank, strict=True))
        if ms is not None
    ]
    keep = {i for _, _, i in heapq.nlargest(TOP_K, timed)}
    keep.update(i for i, rank in enumerate(figures.rank) if rank in named)
    return sorted(keep)


_PROCESS_KEYS: tuple[tuple[MetricDef, str, float], ...] = (
    (PROCESS_CPU, "cpu_percent", 0.01),
    (PROCESS_RSS, "ram_used_bytes", 1.0),
    (PROCESS_GPU_USED, "gpu_memory_used_bytes", 1.0),
    (PROCESS_GPU_RESERVED, "gpu_memory_reserved_bytes", 1.0),
)
_SYSTEM_KEYS: tuple[tuple[MetricDef, str, float], ...] = (
    (SYSTEM_CPU, "cpu_percent", 0.01),
    (SYSTEM_RAM_USED, "ram_used_bytes", 1.0),
    (SYSTEM_RAM_TOTAL, "ram_total_bytes", 1.0),
)
_GPU_KEYS: tuple[tuple[MetricDef, str, float], ...] = (
    (GPU_UTIL, "utilization_percent", 0.01),
    (GPU_MEM_USED, "memory_used_bytes", 1.0),
    (GPU_MEM_TOTAL, "memory_total_bytes", 1.0),
    (GPU_TEMP, "temperature_c", 1.0),
    (GPU_POWER, "power_usage_w", 1.0),
    (GPU_POWER_LIMIT, "power_limit_w", 1.0),
)


def _rank_series(out: dict[str, list[Sample]], ranks: Sequence[RankFigures]) -> None:
    """Each of ``ranks``' own series: its gauges, and its histograms when the state
    copied them."""
    rank_step = out[RANK_STEP_TIME.name]
    steps, last_step, last_time = out[STEPS.name], out[LAST_STEP.name], out[LAST_STEP_TIME.name]
    step_hists, phase_hists = out[STEP_TIME.name], out[PHASE_TIME.name]
    peak_allocated, peak_reserved = out[PEAK_ALLOCATED.name], out[PEAK_RESERVED.name]
    process = [(out[metric.name], key, scale) for metric, key, scale in _PROCESS_KEYS]
    for r in ranks:
        rank = str(r.rank)
        by_rank, rank_node = (rank,), (rank, str(r.node))
        if r.step_hist is not None:
            step_hists.append(Sample(rank_node, histogram=r.step_hist))
        if r.phase_hist is not None:
            for phase, hist in sorted(r.phase_hist.items()):
                phase_hists.append(Sample((rank, phase), histogram=hist))
        if r.recent_median_ms is not None:
            rank_step.append(Sample(rank_node, r.recent_median_ms / 1000.0))
        steps.append(Sample(by_rank, r.steps))
        if r.steps:
            last_step.append(Sample(by_rank, r.last_step))
            last_time.append(Sample(by_rank, r.last_end_ns / 1e9))
        for device, (allocated, reserved) in sorted(r.peak_memory.items()):
            if allocated is not None:
                peak_allocated.append(Sample((rank, device), allocated))
            if reserved is not None:
                peak_reserved.append(Sample((rank, device), reserved))
        p = r.process
        for samples, key, scale in process:
            if key in p:
                samples.append(Sample(by_rank, p[key] * scale))


def _quantiles(
    out: dict[str, list[Sample]], metric: MetricDef, values: list[float] | NDArray[Any]
) -> None:
    """``metric``'s series: one per :data:`QUANTILES` of ``values`` (none when empty)."""
    if len(values) < _PARTITION_FROM:
        if len(values):
            values = sorted(values.tolist() if not isinstance(values, list) else values)
            out[metric.name].extend(
                Sample((label,), percentile(values, q)) for label, q in QUANTILES
            )
        return
    import numpy as np

    # ``percentile``'s figures (its arithmetic on the same two closest values), with the
    # few positions it reads put in place by one partition instead of a sort.
    n = len(values)
    spots = []
    for label, q in QUANTILES:
        pos = (n - 1) * q / 100.0
        lo = math.floor(pos)
        spots.append((label, lo, min(lo + 1, n - 1), pos - lo))
    kth = sorted({i for _, lo, hi, _ in spots for i in (lo, hi)})
    part = np.partition(np.asarray(values, dtype=np.float64), kth).tolist()
    out[metric.name].extend(
        Sample((label,), part[lo] + (part[hi] - part[lo]) * frac) for label, lo, hi, frac in spots
    )


_PARTITION_FROM = 64
"""Values from which a distribution's quantiles come from a partition, not a sort."""


def _rank_distributions(out: dict[str, list[Sample]], figures: MetricFigures) -> None:
    """The distributions across every rank of :data:`RANK_DISTRIBUTIONS`."""
    import numpy as np

    reported = [i for i, n in enumerate(figures.steps) if n]
    last_step, last_end_ns = figures.last_step, figures.last_end_ns
    values: dict[MetricDef, list[float] | NDArray[Any]] = {
        RANK_STEP_TIME: [ms / 1000.0 for ms in figures.recent_median_ms if ms is not None],
        STEPS: [float(n) for n in figures.steps],
        LAST_STEP: [float(last_step[i]) for i in reported],
        LAST_STEP_TIME: [last_end_ns[i] / 1e9 for i in reported],
    }
    # The dict-valued figures from the state's tables: a column per figure (NaN: none).
    for metric, column in (
        (PEAK_ALLOCATED, figures.peak_table[:, :, 0]),
        (PEAK_RESERVED, figures.peak_table[:, :, 1]),
        *(
            (metric, figures.process_table[:, PROCESS_COLUMNS.index(key)] * scale)
            for metric, key, scale in _PROCESS_KEYS
        ),
    ):
        values[metric] = column[~np.isnan(column)]
    for distribution, of in RANK_DISTRIBUTIONS:
        _quantiles(out, distribution, values[of])


def _median(values: list[float]) -> float:
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2.0


def _group_step_times(
    out: dict[str, list[Sample]], figures: MetricFigures, layout: Mapping[int, Coordinates]
) -> None:
    """Each node's and each pipeline stage's median over its ranks of their median step
    time (the slowest :data:`MAX_NODE_SERIES` nodes and :data:`MAX_STAGE_SERIES` stages)."""
    by_node: dict[int, list[float]] = {}
    by_stage: dict[int, list[float]] = {}
    for rank, node, ms in zip(figures.rank, figures.node, figures.recent_median_ms, strict=True):
        if ms is None:
            continue
        group = by_node.get(node)
        if group is None:
            by_node[node] = [ms]
        else:
            group.append(ms)
        if layout:
            place = layout.get(rank, {}).get("pp")
            if place is not None:
                by_stage.setdefault(place[0], []).append(ms)
    groups = (
        (NODE_STEP_TIME, by_node, MAX_NODE_SERIES),
        (STAGE_STEP_TIME, by_stage, MAX_STAGE_SERIES),
    )
    for metric, by_group, most in groups:
        if metric is STAGE_STEP_TIME and len(by_group) < 2:
            continue  # no pipeline: the job's figures say it all
        medians = [(group, _median(values)) for group, values in by_group.items()]
        if len(medians) > most:
            medians = heapq.nlargest(most, medians, key=lambda g: (g[1], -g[0]))
        out[metric.name].extend(Sample((str(group),), ms / 1000.0) for group, ms in sorted(medians))


def _node_distributions(
    out: dict[str, list[Sample]], system: NDArray[Any], gpus: NDArray[Any]
) -> None:
    """The distributions across every node and GPU of :data:`NODE_DISTRIBUTIONS`, from
    the state's node tables (a column per figure; NaN: not reported)."""
    import numpy as np

    columns = [system[:, SYSTEM_COLUMNS.index(key)] * scale for _, key, scale in _SYSTEM_KEYS]
    columns += [gpus[:, :, GPU_COLUMNS.index(key)] * scale for _, key, scale in _GPU_KEYS]
    for (distribution, _), column in zip(NODE_DISTRIBUTIONS, columns, strict=True):
        _quantiles(out, distribution, column[~np.isnan(column)])


def _node_series(out: dict[str, list[Sample]], nodes: Sequence[NodeLive]) -> None:
    """The nodes' system and GPU figures: each node's and each GPU's own series, and
    their distributions across every node and GPU."""
    # (its per-node samples, its key, its scale, every node's or GPU's values), in
    # NODE_DISTRIBUTIONS' order: lists, not dicts keyed by metric, on this hot loop.
    Figure = tuple[list[Sample], str, float, list[float]]
    system: list[Figure] = [(out[m.name], key, scale, []) for m, key, scale in _SYSTEM_KEYS]
    gpus: list[Figure] = [(out[m.name], key, scale, []) for m, key, scale in _GPU_KEYS]
    for n in nodes:
        node = str(n.node)
        for samples, key, scale, across in system:
            if key in n.system:
                value = n.system[key] * scale
                across.append(value)
                samples.append(Sample((node,), value))
        for index, gpu in sorted(n.gpus.items()):
            labels = (node, str(index))
            for samples, key, scale, across in gpus:
                if key in gpu:
                    value = gpu[key] * scale
                    across.append(value)
                    samples.append(Sample(labels, value))
    for (distribution, _), (_, _, _, across) in zip(
        NODE_DISTRIBUTIONS, (*system, *gpus), strict=True
    ):
        _quantiles(out, distribution, across)


def _straggler_figures(view: StragglerView | None) -> tuple[str, list[tuple[int, str, float]]]:
    """(verdict, [(rank, phase, excess ms)]) of a straggler view; ``n/a`` without one."""
    if view is None:
        return "n/a", []
    return view.verdict, [(s.rank, s.phase, s.excess_ms) for s in view.stragglers]


def _histogram_series(bounds: tuple[float, ...]) -> int:
    return len(bounds) + 3  # the buckets, +Inf, _sum and _count


DEFAULT_RANK_SERIES_MAX_RANKS: int = RANK_SERIES_MAX_RANKS.default or 0
"""``rank_series_max_ranks``' default: every rank's own series up to this many ranks."""


def series_estimate(
    ranks: int,
    nodes: int,
    user_phases: int = 0,
    gpus_per_node: int = 0,
    *,
    max_ranks: int = DEFAULT_RANK_SERIES_MAX_RANKS,
    stages: int = 0,
) -> int:
    """Series the endpoint serves for a run of this shape (one device per rank, every
    rank's figures reported, ``stages`` pipeline stages, no straggler named, every
    stream exported) with ``rank_series_max_ranks`` at ``max_ranks``."""
    phases = len(BUILT_IN_PHASES) + user_phases
    step, phase = _histogram_series(STEP_BUCKETS_S), _histogram_series(PHASE_BUCKETS_S)
    every_rank = ranks <= max_ranks
    per_rank = len(_PER_RANK) + len(_PER_DEVICE)
    per_node = 0
    if every_rank:
        per_rank += step + phase * phases
        per_node = len(_PER_NODE) + len(_PER_GPU) * gpus_per_node
    shown = ranks if every_rank else min(ranks, TOP_K)
    groups = min(nodes, MAX_NODE_SERIES) + (min(stages, MAX_STAGE_SERIES) if stages > 1 else 0)
    across = len(RANK_DISTRIBUTIONS) + len(_PER_NODE) + (len(_PER_GPU) if gpus_per_node else 0)
    job_histograms = step + phase * phases  # JOB_STEP_TIME, JOB_PHASE_TIME
    # The rest: one series each (STRAGGLERS its one verdict, the export's one stream).
    counted = {*_PER_RANK, *_PER_DEVICE, *_PER_NODE, *_PER_GPU, *RANK_HISTOGRAMS}
    counted |= {d for d, _ in (*RANK_DISTRIBUTIONS, *NODE_DISTRIBUTIONS)}
    counted |= {JOB_STEP_TIME, JOB_PHASE_TIME, NODE_STEP_TIME, STAGE_STEP_TIME}
    counted |= {STRAGGLER_EXCESS, SLOWDOWN, SLOW_STAGE_EXCESS, IMBALANCE_SPREAD}  # none here
    per_job = sum(1 for m in METRICS if m not in counted)
    return (
        shown * per_rank
        + nodes * per_node
        + groups
        + across * len(QUANTILES)
        + job_histograms
        + per_job
    )


SERIES_SHAPES: tuple[tuple[str, int, int, int, int], ...] = (
    ("8 ranks, 1 node, 8 GPUs", 8, 1, 0, 8),
    ("64 ranks, 8 nodes, 8 GPUs each", 64, 8, 0, 8),
    ("1,024 ranks, 128 nodes, 8 GPUs each", 1024, 128, 0, 8),
    ("1,024 ranks, 128 nodes, 8 GPUs each, 8 user phases", 1024, 128, 8, 8),
    ("10,240 ranks, 1,280 nodes, 8 GPUs each", 10240, 1280, 0, 8),
    ("10,240 ranks, 1,280 nodes, 8 GPUs each, 8 user phases", 10240, 1280, 8, 8),
)
"""The run shapes of the docs' series table: (words, ranks, nodes, user phases, GPUs
per node)."""


def series_table_markdown() -> str:
    """The series table of docs/monitoring.md, from :func:`series_estimate`."""
    rows = [
        "| run | series | with every rank's own series (`--rank-series-max-ranks` at its ranks) |",
        "|---|---|---|",
    ]
    for words, ranks, nodes, user_phases, gpus in SERIES_SHAPES:
        bounded = series_estimate(ranks, nodes, user_phases, gpus)
        detailed = series_estimate(ranks, nodes, user_phases, gpus, max_ranks=ranks)
        rows.append(f"| {words} | {bounded:,} | {detailed:,} |")
    return "\n".join(rows) + "\n"


def metrics_table_markdown(metrics: Sequence[MetricDef] = METRICS) -> str:
    """The metric table of docs/monitoring.md, from :data:`METRICS`."""
    rows = [
        "| Prometheus name | OTLP name | Kind | Unit | Labels | From | Meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in metrics:
        labels = ", ".join(f"`{label}`" for label in m.labels) or "—"
        rows.append(
            f"| `{m.name}` | `{otlp_name(m)}` | {m.kind} | `{m.unit}` | {labels} | "
            f"{m.source} | {m.help} |"
        )
    return "\n".join(rows) + "\n"
