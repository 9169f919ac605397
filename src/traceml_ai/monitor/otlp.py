"""The OTLP exporter: the live metrics and sampled step traces, over OpenTelemetry.

Where to send comes only from the standard ``OTEL_*`` variables, read by the SDK's
own exporters (endpoint, headers, protocol, timeout, certificates); this module picks
the HTTP or gRPC exporter by ``OTEL_EXPORTER_OTLP_[TRACES_|METRICS_]PROTOCOL``.

Nothing here uses the SDK's meter or tracer providers. The metrics are already
aggregated in the :class:`~traceml_ai.monitor._state.LiveState` (the same figures
Prometheus serves, from :func:`~traceml_ai.monitor.metrics.collect`), so each export
builds the SDK's data objects from them and hands them to the exporter: the cost is
one pass over the families per export interval, not one SDK call per value. Traces
are built the same way: a sampled step becomes finished ``ReadableSpan`` objects (the
step and its phases, at their measured times) and goes to the span exporter in
batches.

One thread does all the exporting: the sink is an exporter of the live views' one
sink worker (:mod:`~traceml_ai.monitor._sink_worker`). The feed thread only samples
and queues (:meth:`OtlpSink.on_steps`); a full queue drops the newest steps and counts
their spans. A receiver that is down, slow or gone costs counted losses: the
exporters' retries run on the worker's thread, :meth:`OtlpSink.close` abandons that
thread when its budget is spent, and the SDK's log messages are kept from the terminal
(the user sees one ``traceml: otlp:`` line the first time an export fails).

This module is the sink and its lifecycle; its parts live beside it: ``_otlp_config``
(the ``OTEL_*`` variables and the SDK's exporters), ``_otlp_traces`` (which steps are
sampled, their spans), ``_otlp_metrics`` (the metric data) and ``_otlp_log`` (the SDK's
log messages, why an export failed).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.util.types import AttributeValue

from traceml_ai.monitor._otlp_config import (
    DEFAULT_METRIC_INTERVAL_MS,
    endpoint_of,
    header_problems,
    make_metric_exporter,
    make_span_exporter,
    metric_interval_s,
    signal_on,
)
from traceml_ai.monitor._otlp_log import SdkLog, failure_reason, quiet_sdk_logs
from traceml_ai.monitor._otlp_metrics import build_metrics_data
from traceml_ai.monitor._otlp_traces import (
    PhaseSpan,
    SpanBuilder,
    StepSampler,
    layout_phases,
    span_count,
)
from traceml_ai.monitor._sink import SinkStartError
from traceml_ai.monitor._sink_worker import SENT, Outcome, SinkWorker
from traceml_ai.monitor._state import StepSeen
from traceml_ai.monitor.metrics import traceml_version

if TYPE_CHECKING:
    from traceml_ai.monitor._service import Monitoring

__all__ = [
    "MAX_BATCH_SPANS",
    "MAX_QUEUED_SPANS",
    "OtlpSink",
    "PhaseSpan",
    "StepSampler",
    "build_metrics_data",
    "layout_phases",
    "start_otlp",
]

_log = logging.getLogger("traceml_ai.monitor")

MAX_BATCH_SPANS = 512
"""Spans per export request (the SDK's batch processor's default batch)."""
MAX_QUEUED_SPANS = 16384
"""Spans waiting for the export thread; beyond it the newest steps are dropped."""
TRACE_FLUSH_S = 1.0
"""How long sampled steps wait before they are sent (unless a full batch is ready)."""
_SCOPE_NAME = "traceml_ai"

# -- the sink ----------------------------------------------------------------------

SampledStep = tuple[StepSeen, str]
"""A sampled step and why it was picked (``periodic`` or ``slow``)."""


def _spans_of(sampled: SampledStep) -> int:
    return span_count(sampled[0])


class OtlpSink:
    """The running OTLP export: a :class:`~traceml_ai.monitor._sink_worker.SinkWorker`
    of sampled steps (their spans in batches) whose interval work is the metric export."""

    name = "otlp"
    straggler_on_demand = True
    """A metric export has the straggler view made when it is older than the feed's
    period."""

    def __init__(
        self,
        monitoring: Monitoring,
        *,
        span_exporter: SpanExporter | None,
        metric_exporter: MetricExporter | None,
        metric_interval_s: float,
        sample_every: int,
        sdk_log: SdkLog | None = None,
    ) -> None:
        self._monitoring = monitoring
        self._span_exporter = span_exporter
        self._metric_exporter = metric_exporter
        self.sampler = StepSampler(sample_every)
        self._sdk_log = sdk_log or quiet_sdk_logs()
        run = monitoring.run
        self._base_attributes: dict[str, AttributeValue] = {
            "service.name": "traceml",
            "traceml.run.name": run.run_name,
            "host.name": run.host,
        }
        self._resource_for: tuple[int | None, Resource] | None = None
        self._scope = InstrumentationScope(_SCOPE_NAME, traceml_version())
        self._builder = SpanBuilder(self._scope)
        self._start_ns = int(monitoring.state.started_unix_s * 1e9)
        self._lock = threading.Lock()
        self._failure_said = False
        self._final_metrics_done = metric_exporter is None
        self.metric_exports = 0
        self.metric_exports_failed = 0
        self.worker: SinkWorker[SampledStep] = SinkWorker(
            "otlp",
            self,
            max_items=MAX_QUEUED_SPANS,
            max_size=MAX_QUEUED_SPANS,
            batch_size=MAX_BATCH_SPANS,
            flush_s=TRACE_FLUSH_S,
            interval_s=metric_interval_s if metric_exporter is not None else None,
            size_of=_spans_of,
            report_failure=self._say_failure,
        )

    def start(self) -> None:
        self.worker.start()

    # -- the feed thread ---------------------------------------------------------------

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """Sample ``steps`` and queue the picked ones; never waits on the exports."""
        if self._span_exporter is None:
            return
        for sampled in self.sampler.pick(steps):
            self.worker.put(sampled)

    # -- stopping ----------------------------------------------------------------------

    def close(self, timeout_s: float) -> Mapping[str, int]:
        """Send what is queued and the final metrics within ``timeout_s``; what could
        not be sent by then is counted (the export thread is left behind if an export is
        stuck in the receiver)."""
        counts = self.worker.close(timeout_s)
        if counts.timed_out:
            self._say_failure(
                f"an export was still waiting on the receiver after {timeout_s:.1f} s"
            )
        with self._lock:
            if not self._final_metrics_done:
                self.metric_exports_failed += 1
                self._final_metrics_done = True
            losses = {
                "spans_dropped": counts.dropped + counts.abandoned,
                "spans_failed": counts.failed,
                "metric_exports_failed": self.metric_exports_failed,
            }
        return {what: n for what, n in losses.items() if n}

    # -- the exporter, on the worker's thread --------------------------------------------

    def begin(self) -> None:
        """Nothing to prepare: the SDK's exporters were made at start."""

    def ready(self, final: bool) -> bool:
        """Sampled steps go as soon as a batch is due."""
        return True

    def export(self, batch: Sequence[SampledStep]) -> Outcome:
        """One request of the sampled steps' spans."""
        exporter = self._span_exporter
        assert exporter is not None
        resource = self._resource()
        spans: list[ReadableSpan] = []
        for step, reason in batch:
            spans.extend(self._builder.spans(step, reason, resource))
        self._sdk_log.messages.clear()
        try:
            ok = exporter.export(spans) == SpanExportResult.SUCCESS
        except Exception:
            _log.debug("otlp: span export raised", exc_info=True)
            ok = False
        if ok:
            return SENT
        failed = sum(span_count(step) for step, _ in batch)
        return Outcome(failed, self._failure(list(self._sdk_log.messages), exporter))

    def on_interval(self, final: bool) -> Sequence[SampledStep]:
        """One metric export (the final one with ``final``)."""
        if self._metric_exporter is not None and self._send_metrics() and final:
            with self._lock:
                self._final_metrics_done = True
        return ()

    def finish(self) -> None:
        """Shut the SDK's exporters down (they flush nothing of ours: every export was
        one synchronous request)."""
        self._shutdown_exporters()

    def abort(self) -> None:
        """Ends the exporters' retry waits, so that the thread can return soon."""
        self._shutdown_exporters()

    def _shutdown_exporters(self) -> None:
        for exporter in (self._span_exporter, self._metric_exporter):
            if exporter is None:
                continue
            try:
                exporter.shutdown()
            except Exception:
                _log.debug("otlp: exporter shutdown failed", exc_info=True)

    def _resource(self) -> Resource:
        """The run's resource: ``traceml`` defaults, then what ``OTEL_SERVICE_NAME`` and
        ``OTEL_RESOURCE_ATTRIBUTES`` say (the user's word wins). Rebuilt once the world
        size is known."""
        world = self._monitoring.state.world_size
        cached = self._resource_for
        if cached is not None and cached[0] == world:
            return cached[1]
        attributes = dict(self._base_attributes)
        if world is not None:
            attributes["traceml.world_size"] = world
        resource = Resource.create(attributes).merge(OTELResourceDetector().detect())
        self._resource_for = (world, resource)
        return resource

    def _send_metrics(self) -> bool:
        exporter = self._metric_exporter
        assert exporter is not None
        monitoring = self._monitoring
        monitoring.feed.straggler_for_read()
        data = build_metrics_data(
            monitoring.families(),
            self._resource(),
            self._scope,
            self._start_ns,
            time.time_ns(),
        )
        self._sdk_log.messages.clear()
        try:
            ok = exporter.export(data) == MetricExportResult.SUCCESS
        except Exception:
            _log.debug("otlp: metric export raised", exc_info=True)
            ok = False
        with self._lock:
            if ok:
                self.metric_exports += 1
            else:
                self.metric_exports_failed += 1
        if not ok:
            self._say_failure(self._failure(list(self._sdk_log.messages), exporter))
        return ok

    def _failure(self, messages: Sequence[str], exporter: object) -> str:
        """Why an export to ``exporter`` failed, with where it went."""
        reason = failure_reason(messages, getattr(exporter, "_endpoint", None))
        return f"export to {endpoint_of(exporter)} failed ({reason})"

    def _say_failure(self, what: str) -> None:
        """Say once, in one line, that exports fail and why."""
        with self._lock:
            if self._failure_said:
                return
            self._failure_said = True
        self._monitoring.report(
            f"traceml: otlp: {what}; training and the files go on, and what the live "
            "export loses is counted in aggregator/stats.json"
        )


def start_otlp(monitoring: Monitoring) -> OtlpSink:
    """Start the OTLP export the ``OTEL_*`` variables describe; one line says where."""
    traces = signal_on("TRACES")
    metrics = signal_on("METRICS")
    interval_s = metric_interval_s() if metrics else DEFAULT_METRIC_INTERVAL_MS / 1000.0
    sdk_log = quiet_sdk_logs()
    span_exporter = make_span_exporter() if traces else None
    try:
        metric_exporter = make_metric_exporter() if metrics else None
    except SinkStartError:
        if span_exporter is not None:
            span_exporter.shutdown()
        raise
    sink = OtlpSink(
        monitoring,
        span_exporter=span_exporter,
        metric_exporter=metric_exporter,
        metric_interval_s=interval_s,
        sample_every=monitoring.settings.otlp_trace_sample,
        sdk_log=sdk_log,
    )
    sink.start()
    parts: list[str] = []
    if span_exporter is not None:
        every = sink.sampler.every
        which = "every step" if every == 1 else f"1 step in {every} per rank and slow steps"
        parts.append(f"traces ({which}) to {endpoint_of(span_exporter)}")
    if metric_exporter is not None:
        parts.append(f"metrics every {interval_s:g} s to {endpoint_of(metric_exporter)}")
    monitoring.report(
        "traceml: otlp: " + ("; ".join(parts) if parts else "OTEL_*_EXPORTER=none: nothing to send")
    )
    for line in header_problems(os.environ):
        monitoring.report(line)
    return sink
