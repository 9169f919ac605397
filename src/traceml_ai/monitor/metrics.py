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

Series are bounded for large jobs: the step and phase histograms are the job's (every
rank's steps in one), each rank has a handful of gauges (its median step time among
them), and each rank's own histograms (:data:`RANK_HISTOGRAMS`, most of the series:
one per rank and phase) are served only while the run has at most
``rank_histograms_max_ranks`` ranks. Phases are the five built-in ones plus at most
``MAX_USER_PHASES`` user names (the rest are ``other``), devices at most 16 per rank,
GPUs at most 64 per node. :func:`series_estimate` gives the count for a run's shape.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

import attrs

from traceml_ai.monitor._state import (
    MAX_USER_PHASES,
    PHASE_BUCKETS_S,
    STEP_BUCKETS_S,
    WINDOW_STEPS,
    Histogram,
    LiveState,
)
from traceml_ai.run_summary import BUILT_IN_PHASES, StragglerView

__all__ = [
    "METRICS",
    "RANK_HISTOGRAMS",
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
_RANK_DETAIL = "Served while the run has at most --rank-histograms-max-ranks ranks."

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
    f"Median duration of the rank's recent steps (its last {WINDOW_STEPS}).", "step_time",
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
STEPS = _m("traceml_steps_total", "counter", "{step}", ("rank",), "Steps received.", "step_time")
LAST_STEP = _m("traceml_last_step", "gauge", "{step}", ("rank",), "The rank's latest step number.", "step_time")  # fmt: skip
LAST_STEP_TIME = _m(
    "traceml_last_step_timestamp_seconds", "gauge", "s", ("rank",),
    "When the rank's latest step ended (Unix time).", "step_time",
)  # fmt: skip
PEAK_ALLOCATED = _m(
    "traceml_step_peak_allocated_bytes", "gauge", "By", ("rank", "device"),
    "Peak tensor memory allocated during the rank's latest step on the device.", "step_memory",
)  # fmt: skip
PEAK_RESERVED = _m(
    "traceml_step_peak_reserved_bytes", "gauge", "By", ("rank", "device"),
    "Peak memory reserved by the caching allocator during the latest step.", "step_memory",
)  # fmt: skip
PROCESS_CPU = _m(
    "traceml_process_cpu_cores", "gauge", "{core}", ("rank",),
    "CPU the training process uses, in cores (1.5 = one and a half cores).", "process",
)  # fmt: skip
PROCESS_RSS = _m(
    "traceml_process_resident_memory_bytes", "gauge", "By", ("rank",),
    "Resident memory of the training process.", "process",
)  # fmt: skip
PROCESS_GPU_USED = _m(
    "traceml_process_gpu_memory_used_bytes", "gauge", "By", ("rank",),
    "GPU memory the rank's process has allocated on its GPU.", "process",
)  # fmt: skip
PROCESS_GPU_RESERVED = _m(
    "traceml_process_gpu_memory_reserved_bytes", "gauge", "By", ("rank",),
    "GPU memory the rank's allocator has reserved on its GPU.", "process",
)  # fmt: skip
SYSTEM_CPU = _m(
    "traceml_system_cpu_ratio", "gauge", "1", ("node",),
    "Host-wide CPU use, 0 to 1.", "system",
)  # fmt: skip
SYSTEM_RAM_USED = _m("traceml_system_memory_used_bytes", "gauge", "By", ("node",), "Host RAM in use.", "system")  # fmt: skip
SYSTEM_RAM_TOTAL = _m("traceml_system_memory_total_bytes", "gauge", "By", ("node",), "Host RAM.", "system")  # fmt: skip
GPU_UTIL = _m("traceml_gpu_utilization_ratio", "gauge", "1", ("node", "gpu"), "GPU utilisation, 0 to 1.", "system")  # fmt: skip
GPU_MEM_USED = _m("traceml_gpu_memory_used_bytes", "gauge", "By", ("node", "gpu"), "GPU memory in use.", "system")  # fmt: skip
GPU_MEM_TOTAL = _m("traceml_gpu_memory_total_bytes", "gauge", "By", ("node", "gpu"), "GPU memory.", "system")  # fmt: skip
GPU_TEMP = _m("traceml_gpu_temperature_celsius", "gauge", "Cel", ("node", "gpu"), "GPU temperature.", "system")  # fmt: skip
GPU_POWER = _m("traceml_gpu_power_watts", "gauge", "W", ("node", "gpu"), "GPU power draw.", "system")  # fmt: skip
GPU_POWER_LIMIT = _m("traceml_gpu_power_limit_watts", "gauge", "W", ("node", "gpu"), "GPU power limit.", "system")  # fmt: skip
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

METRICS: tuple[MetricDef, ...] = (
    RUN_INFO, JOB_STEP_TIME, JOB_PHASE_TIME, RANK_STEP_TIME, STEP_TIME, PHASE_TIME,
    STEPS, LAST_STEP, LAST_STEP_TIME, PEAK_ALLOCATED, PEAK_RESERVED,
    PROCESS_CPU, PROCESS_RSS, PROCESS_GPU_USED, PROCESS_GPU_RESERVED,
    SYSTEM_CPU, SYSTEM_RAM_USED, SYSTEM_RAM_TOTAL,
    GPU_UTIL, GPU_MEM_USED, GPU_MEM_TOTAL, GPU_TEMP, GPU_POWER, GPU_POWER_LIMIT,
    STRAGGLERS, STRAGGLER_EXCESS, SLOWDOWN, SLOW_STAGE_EXCESS, IMBALANCE_SPREAD,
    EXPORT_RECORDS, EXPORT_FAILED, EXPORT_DROPPED, REJECTED_CONNECTIONS,
    RANKS_EXPECTED, RANKS_REPORTING, RANKS_FINISHED, RANKS_MISSING, LIVE_DROPPED,
)  # fmt: skip
"""Every metric, in the order of the docs' table."""

RANK_HISTOGRAMS: tuple[MetricDef, ...] = (STEP_TIME, PHASE_TIME)
"""Each rank's own histograms: served only while the run has at most
``rank_histograms_max_ranks`` ranks (most of the series otherwise)."""

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
    state: LiveState, health: Health, *, run_name: str, rank_histograms_max_ranks: int
) -> list[Family]:
    """Every metric's series now, in :data:`METRICS` order (empty families included);
    :data:`RANK_HISTOGRAMS` only while the run has at most ``rank_histograms_max_ranks``
    ranks."""
    out: dict[str, list[Sample]] = {m.name: [] for m in METRICS}

    def add(metric: MetricDef, labels: tuple[str, ...], value: float) -> None:
        out[metric.name].append(Sample(labels, value))

    add(RUN_INFO, (run_name, traceml_version()), 1)
    figures = state.metric_figures(rank_histograms_max_ranks)
    out[JOB_STEP_TIME.name].append(Sample((), histogram=figures.job_step))
    for phase, hist in figures.job_phases.items():
        out[JOB_PHASE_TIME.name].append(Sample((phase,), histogram=hist))
    rank_step = out[RANK_STEP_TIME.name]
    steps, last_step, last_time = out[STEPS.name], out[LAST_STEP.name], out[LAST_STEP_TIME.name]
    step_hists, phase_hists = out[STEP_TIME.name], out[PHASE_TIME.name]
    peak_allocated, peak_reserved = out[PEAK_ALLOCATED.name], out[PEAK_RESERVED.name]
    process = [
        (out[metric.name], key, scale)
        for metric, key, scale in (
            (PROCESS_CPU, "cpu_percent", 0.01),
            (PROCESS_RSS, "ram_used_bytes", 1.0),
            (PROCESS_GPU_USED, "gpu_memory_used_bytes", 1.0),
            (PROCESS_GPU_RESERVED, "gpu_memory_reserved_bytes", 1.0),
        )
    ]
    for r in figures.ranks:
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
    system = [
        (out[metric.name], key, scale)
        for metric, key, scale in (
            (SYSTEM_CPU, "cpu_percent", 0.01),
            (SYSTEM_RAM_USED, "ram_used_bytes", 1.0),
            (SYSTEM_RAM_TOTAL, "ram_total_bytes", 1.0),
        )
    ]
    gpus = [
        (out[metric.name], key, scale)
        for metric, key, scale in (
            (GPU_UTIL, "utilization_percent", 0.01),
            (GPU_MEM_USED, "memory_used_bytes", 1.0),
            (GPU_MEM_TOTAL, "memory_total_bytes", 1.0),
            (GPU_TEMP, "temperature_c", 1.0),
            (GPU_POWER, "power_usage_w", 1.0),
            (GPU_POWER_LIMIT, "power_limit_w", 1.0),
        )
    ]
    for n in state.nodes():
        node = (str(n.node),)
        for samples, key, scale in system:
            if key in n.system:
                samples.append(Sample(node, n.system[key] * scale))
        for index, gpu in sorted(n.gpus.items()):
            labels = (node[0], str(index))
            for samples, key, scale in gpus:
                if key in gpu:
                    samples.append(Sample(labels, gpu[key] * scale))
    view = state.straggler
    verdict, named = _straggler_figures(view)
    add(STRAGGLERS, (verdict,), len(named))
    for slow_rank, phase, excess_ms in named:
        add(STRAGGLER_EXCESS, (str(slow_rank), phase), excess_ms / 1000.0)
    for cause in view.causes() if view is not None else ():
        if cause.slowdown is not None:
            add(SLOWDOWN, (cause.verdict,), cause.slowdown.factor)
        for stage in cause.stages:
            add(SLOW_STAGE_EXCESS, (str(stage.stage),), stage.excess_ms / 1000.0)
        if cause.imbalance is not None:
            add(IMBALANCE_SPREAD, (), cause.imbalance.spread_ms / 1000.0)
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


def _straggler_figures(view: StragglerView | None) -> tuple[str, list[tuple[int, str, float]]]:
    """(verdict, [(rank, phase, excess ms)]) of a straggler view; ``n/a`` without one."""
    if view is None:
        return "n/a", []
    return view.verdict, [(s.rank, s.phase, s.excess_ms) for s in view.stragglers]


def _histogram_series(bounds: tuple[float, ...]) -> int:
    return len(bounds) + 3  # the buckets, +Inf, _sum and _count


def series_estimate(
    ranks: int,
    nodes: int,
    user_phases: int = 0,
    gpus_per_node: int = 0,
    *,
    rank_histograms: bool = False,
) -> int:
    """Series the endpoint serves for a run of this shape (one device per rank, no
    straggler named, every stream exported); ``rank_histograms``: each rank's own
    histograms included."""
    phases = len(BUILT_IN_PHASES) + user_phases
    step, phase = _histogram_series(STEP_BUCKETS_S), _histogram_series(PHASE_BUCKETS_S)
    per_rank = len(_PER_RANK) + len(_PER_DEVICE)
    if rank_histograms:
        per_rank += step + phase * phases
    per_node = len(_PER_NODE) + len(_PER_GPU) * gpus_per_node
    job_histograms = step + phase * phases  # JOB_STEP_TIME, JOB_PHASE_TIME
    # The rest: one series each (STRAGGLERS its one verdict, the export's one stream).
    counted = {*_PER_RANK, *_PER_DEVICE, *_PER_NODE, *_PER_GPU, *RANK_HISTOGRAMS}
    counted |= {JOB_STEP_TIME, JOB_PHASE_TIME, STRAGGLER_EXCESS}  # (none named here)
    counted |= {SLOWDOWN, SLOW_STAGE_EXCESS, IMBALANCE_SPREAD}  # (no cause found here)
    per_job = sum(1 for m in METRICS if m not in counted)
    return ranks * per_rank + nodes * per_node + job_histograms + per_job


SERIES_SHAPES: tuple[tuple[str, int, int, int, int], ...] = (
    ("8 ranks, 1 node, 8 GPUs", 8, 1, 0, 8),
    ("64 ranks, 8 nodes, 8 GPUs each", 64, 8, 0, 8),
    ("1,024 ranks, 128 nodes", 1024, 128, 0, 0),
    ("1,024 ranks, 128 nodes, 8 GPUs each", 1024, 128, 0, 8),
    ("1,024 ranks, 128 nodes, 8 GPUs each, 8 user phases", 1024, 128, 8, 8),
)
"""The run shapes of the docs' series table: (words, ranks, nodes, user phases, GPUs
per node)."""


def series_table_markdown() -> str:
    """The series table of docs/monitoring.md, from :func:`series_estimate`."""
    rows = [
        "| run | series | with each rank's histograms |",
        "|---|---|---|",
    ]
    for words, ranks, nodes, user_phases, gpus in SERIES_SHAPES:
        bounded = series_estimate(ranks, nodes, user_phases, gpus)
        detailed = series_estimate(ranks, nodes, user_phases, gpus, rank_histograms=True)
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
