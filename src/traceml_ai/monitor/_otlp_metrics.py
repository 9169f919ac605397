"""The OTLP metrics: the SDK's export data built from
:func:`~traceml_ai.monitor.metrics.collect`'s families (the figures Prometheus serves),
one pass per export interval and no meter provider."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import cast

from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    HistogramDataPoint,
    Metric,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.export import Histogram as OtelHistogram
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from traceml_ai.monitor.metrics import Family, otlp_name

__all__ = ["build_metrics_data"]


def build_metrics_data(
    families: Sequence[Family],
    resource: Resource,
    scope: InstrumentationScope,
    start_ns: int,
    now_ns: int,
) -> MetricsData:
    """The SDK's export data for :func:`~traceml_ai.monitor.metrics.collect`'s families
    (cumulative counters and histograms since ``start_ns``; families without a series
    are left out)."""
    metrics: list[Metric] = []
    for family in families:
        m = family.metric
        if not family.samples:
            continue
        data: Sum | Gauge | OtelHistogram
        if m.kind == "histogram":
            points: list[HistogramDataPoint] = []
            for sample in family.samples:
                hist = sample.histogram
                if hist is None:
                    continue
                points.append(
                    HistogramDataPoint(
                        attributes=dict(zip(m.labels, sample.labels, strict=True)),
                        start_time_unix_nano=start_ns,
                        time_unix_nano=now_ns,
                        count=hist.n,
                        sum=hist.total,
                        bucket_counts=list(hist.counts),
                        explicit_bounds=list(hist.bounds),
                        # Not tracked by the live state; None leaves them unset in OTLP.
                        min=cast(float, None),
                        max=cast(float, None),
                    )
                )
            data = OtelHistogram(points, AggregationTemporality.CUMULATIVE)
        else:
            counter = m.kind == "counter"
            numbers = [
                NumberDataPoint(
                    attributes=dict(zip(m.labels, sample.labels, strict=True)),
                    start_time_unix_nano=start_ns,
                    time_unix_nano=now_ns,
                    value=_count_value(sample.value) if counter else float(sample.value),
                )
                for sample in family.samples
            ]
            if counter:
                data = Sum(numbers, AggregationTemporality.CUMULATIVE, is_monotonic=True)
            else:
                data = Gauge(numbers)
        metrics.append(Metric(name=otlp_name(m), description=m.help, unit=m.unit, data=data))
    return MetricsData(
        [ResourceMetrics(resource, [ScopeMetrics(scope, metrics, "")], "")],
    )


def _count_value(value: float) -> int | float:
    """Counters are counts: sent as integers when they are whole."""
    return int(value) if math.isfinite(value) and float(value).is_integer() else float(value)
