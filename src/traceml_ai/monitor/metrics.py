"""The live metrics: defined once here, served by Prometheus and OTLP alike.

:data:`METRICS` is the one list of every metric the aggregator publishes: its
Prometheus name, kind, unit, labels and meaning. :func:`collect` reads a
:class:`~traceml_ai.monitor._state.LiveState` and the aggregator's own health into
:class:`Family` values, which the Prometheus endpoint writes as its exposition and
the OTLP exporter as OTLP data points; ``docs/monitoring.md``'s metric table is
:func:`metrics_table_markdown` (a test keeps the page in step).

Names follow Prometheus' conventions: base units (seconds, bytes, ratios), counters
end in ``_total``. OTLP takes the same name without ``_total`` (:func:`otlp_name`),
with the unit in the data (UCUM: ``s``, ``By``, ``1`` for ratios, ``{step}``-style
annotations for counts, which OTLP-to-Prometheus translation leaves out of the name),
so that a backend that converts OTLP to Prometheus names arrives at the same series.

Label cardinality is linear in ranks and nodes and otherwise bounded: phases are the
five built-in ones plus at most ``MAX_USER_PHASES`` user names (the rest are
``other``), devices at most 16 per rank, GPUs at most 64 per node. At 1,024 ranks the
endpoint serves about :func:`series_estimate` series.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal

import attrs

from traceml_ai.monitor._state import (
    MAX_USER_PHASES,
    PHASE_BUCKETS_S,
    STEP_BUCKETS_S,
    Histogram,
    LiveState,
)
from traceml_ai.run_summary import BUILT_IN_PHASES, StragglerView

__all__ = [
    "METRICS",
    "Family",
    "Health",
    "MetricDef",
    "Sample",
    "collect",
    "metrics_table_markdown",
    "otlp_name",
    "series_estimate",
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


STEP_TIME = _m(
    "traceml_step_time_seconds", "histogram", "s", ("rank", "node"),
    "Duration of each traced step (the whole step).", "step_time",
)  # fmt: skip
PHASE_TIME = _m(
    "traceml_phase_time_seconds", "histogram", "s", ("rank", "phase"),
    "Time of each phase in each step: dataloader_wait, h2d, forward, backward, optimizer, "
    f"user:NAME (at most {MAX_USER_PHASES} names per run; later ones count as other).",
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
    "verdict as a label: straggler, intermittent, none or n/a (one series).",
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
    STEP_TIME, PHASE_TIME, STEPS, LAST_STEP, LAST_STEP_TIME, PEAK_ALLOCATED, PEAK_RESERVED,
    PROCESS_CPU, PROCESS_RSS, PROCESS_GPU_USED, PROCESS_GPU_RESERVED,
    SYSTEM_CPU, SYSTEM_RAM_USED, SYSTEM_RAM_TOTAL,
    GPU_UTIL, GPU_MEM_USED, GPU_MEM_TOTAL, GPU_TEMP, GPU_POWER, GPU_POWER_LIMIT,
    STRAGGLERS, STRAGGLER_EXCESS,
    EXPORT_RECORDS, EXPORT_FAILED, EXPORT_DROPPED, REJECTED_CONNECTIONS,
    RANKS_EXPECTED, RANKS_REPORTING, RANKS_FINISHED, RANKS_MISSING, LIVE_DROPPED,
)  # fmt: skip
"""Every metric, in the order of the docs' table."""

BUCKETS: Mapping[str, tuple[float, ...]] = {
    STEP_TIME.name: STEP_BUCKETS_S,
    PHASE_TIME.name: PHASE_BUCKETS_S,
}
"""Histogram bucket upper bounds (seconds; +Inf after the last)."""


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


@attrs.frozen
class Sample:
    """One series' value: ``value`` for counters and gauges, ``histogram`` for histograms."""

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


def collect(state: LiveState, health: Health) -> list[Family]:
    """Every metric's series now, in :data:`METRICS` order (empty families included)."""
    out: dict[str, list[Sample]] = {m.name: [] for m in METRICS}

    def add(metric: MetricDef, labels: tuple[str, ...], value: float) -> None:
        out[metric.name].append(Sample(labels, value))

    for r in state.ranks():
        rank = str(r.rank)
        out[STEP_TIME.name].append(Sample((rank, str(r.node)), histogram=r.step_hist))
        for phase, hist in sorted(r.phase_hist.items()):
            out[PHASE_TIME.name].append(Sample((rank, phase), histogram=hist))
        add(STEPS, (rank,), r.steps)
        if r.steps:
            add(LAST_STEP, (rank,), r.last_step)
            add(LAST_STEP_TIME, (rank,), r.last_end_ns / 1e9)
        for device, (allocated, reserved) in sorted(r.peak_memory.items()):
            if allocated is not None:
                add(PEAK_ALLOCATED, (rank, device), allocated)
            if reserved is not None:
                add(PEAK_RESERVED, (rank, device), reserved)
        p = r.process
        for metric, key, scale in (
            (PROCESS_CPU, "cpu_percent", 0.01),
            (PROCESS_RSS, "ram_used_bytes", 1.0),
            (PROCESS_GPU_USED, "gpu_memory_used_bytes", 1.0),
            (PROCESS_GPU_RESERVED, "gpu_memory_reserved_bytes", 1.0),
        ):
            if key in p:
                add(metric, (rank,), p[key] * scale)
    for n in state.nodes():
        node = str(n.node)
        for metric, key, scale in (
            (SYSTEM_CPU, "cpu_percent", 0.01),
            (SYSTEM_RAM_USED, "ram_used_bytes", 1.0),
            (SYSTEM_RAM_TOTAL, "ram_total_bytes", 1.0),
        ):
            if key in n.system:
                add(metric, (node,), n.system[key] * scale)
        for index, gpu in sorted(n.gpus.items()):
            labels = (node, str(index))
            for metric, key, scale in (
                (GPU_UTIL, "utilization_percent", 0.01),
                (GPU_MEM_USED, "memory_used_bytes", 1.0),
                (GPU_MEM_TOTAL, "memory_total_bytes", 1.0),
                (GPU_TEMP, "temperature_c", 1.0),
                (GPU_POWER, "power_usage_w", 1.0),
                (GPU_POWER_LIMIT, "power_limit_w", 1.0),
            ):
                if key in gpu:
                    add(metric, labels, gpu[key] * scale)
    view = state.straggler
    verdict, named = _straggler_figures(view)
    add(STRAGGLERS, (verdict,), len(named))
    for slow_rank, phase, excess_ms in named:
        add(STRAGGLER_EXCESS, (str(slow_rank), phase), excess_ms / 1000.0)
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


def series_estimate(ranks: int, nodes: int, user_phases: int = 0, gpus_per_node: int = 0) -> int:
    """Series the endpoint serves for a run of this shape (one device per rank)."""
    step = len(STEP_BUCKETS_S) + 3  # buckets, +Inf, _sum, _count
    phase = (len(PHASE_BUCKETS_S) + 3) * (len(BUILT_IN_PHASES) + user_phases)
    per_rank = step + phase + 3 + 2 + 4  # steps, last step, its time; memory; process
    per_node = 3 + 6 * gpus_per_node
    return ranks * per_rank + nodes * per_node + 20


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
