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

One thread does all the exporting. The feed thread only samples and queues
(:meth:`OtlpSink.on_steps`); a full queue drops the newest steps and counts their
spans. A receiver that is down, slow or gone costs counted losses: the exporters'
retries run on this module's thread, :meth:`OtlpSink.close` abandons that thread when
its budget is spent, and the SDK's log messages are kept from the terminal (the user
sees one ``traceml: otlp:`` line the first time an export fails).

This module is the sink and its lifecycle; its parts live beside it: ``_otlp_config``
(the ``OTEL_*`` variables and the SDK's exporters), ``_otlp_traces`` (which steps are
sampled, their spans), ``_otlp_metrics`` (the metric data) and ``_otlp_log`` (the SDK's
log messages, why an export failed).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
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


class OtlpSink:
    """The running OTLP export: a queue of sampled steps and one export thread."""

    name = "otlp"

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
        self._metric_interval_s = metric_interval_s
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
        self._wake = threading.Condition(self._lock)
        self._pending: deque[tuple[StepSeen, str]] = deque()
        self._pending_spans = 0
        self._in_flight_spans = 0
        self._metrics_in_flight = False
        self._final_metrics_done = metric_exporter is None
        self._stopping = False
        self._giving_up = False
        self._abandoned = False
        self._failure_reported = False
        self.spans_exported = 0
        self.spans_dropped = 0
        self.spans_failed = 0
        self.metric_exports = 0
        self.metric_exports_failed = 0
        self._thread = threading.Thread(target=self._run, name="traceml-otlp", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- the feed thread ---------------------------------------------------------------

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """Sample ``steps`` and queue the picked ones; never waits on the exports."""
        if self._span_exporter is None:
            return
        picked = self.sampler.pick(steps)
        if not picked:
            return
        with self._lock:
            was_empty = not self._pending
            for step, reason in picked:
                n = span_count(step)
                if self._stopping or self._pending_spans + n > MAX_QUEUED_SPANS:
                    self.spans_dropped += n
                    continue
                self._pending.append((step, reason))
                self._pending_spans += n
            if self._pending and (was_empty or self._pending_spans >= MAX_BATCH_SPANS):
                self._wake.notify()

    # -- stopping ----------------------------------------------------------------------

    def close(self, timeout_s: float) -> Mapping[str, int]:
        """Send what is queued and the final metrics within ``timeout_s``; what could
        not be sent by then is counted (the export thread is left behind if an export is
        stuck in the receiver)."""
        started = time.monotonic()
        margin = min(0.5, timeout_s * 0.2)
        with self._lock:
            self._stopping = True
            self._wake.notify()
        self._thread.join(max(0.0, timeout_s - margin))
        if self._thread.is_alive():
            with self._lock:
                self._giving_up = True
            # Ends the exporters' retry waits, so the thread can return soon.
            self._shutdown_exporters()
            self._thread.join(max(0.0, min(margin / 2, timeout_s - (time.monotonic() - started))))
        else:
            self._shutdown_exporters()
        with self._lock:
            self._abandoned = True
            self.spans_dropped += self._pending_spans + self._in_flight_spans
            self._pending.clear()
            self._pending_spans = self._in_flight_spans = 0
            if not self._final_metrics_done:
                self.metric_exports_failed += 1
                self._final_metrics_done = True
            losses = {
                "spans_dropped": self.spans_dropped,
                "spans_failed": self.spans_failed,
                "metric_exports_failed": self.metric_exports_failed,
            }
        return {what: n for what, n in losses.items() if n}

    def _shutdown_exporters(self) -> None:
        for exporter in (self._span_exporter, self._metric_exporter):
            if exporter is None:
                continue
            try:
                exporter.shutdown()
            except Exception:
                _log.debug("otlp: exporter shutdown failed", exc_info=True)

    # -- the export thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except Exception as exc:
            # A bug, not the receiver: the SDK's exporters report failures as results.
            _log.debug("otlp: the export thread failed", exc_info=True)
            self._report_failure(f"the export thread stopped: {type(exc).__name__}: {exc}")

    def _loop(self) -> None:
        now = time.monotonic()
        next_metrics = now + self._metric_interval_s if self._metric_exporter else math.inf
        next_traces = now + TRACE_FLUSH_S
        while True:
            with self._lock:
                while not self._stopping:
                    now = time.monotonic()
                    due = next_metrics
                    if self._pending:
                        if self._pending_spans >= MAX_BATCH_SPANS:
                            break
                        due = min(due, next_traces)
                    if now >= due:
                        break
                    self._wake.wait(None if math.isinf(due) else due - now)
                stopping = self._stopping
                pending = len(self._pending)
            now = time.monotonic()
            if pending and (stopping or now >= next_traces or self._full_batch_ready()):
                self._send_spans(None if stopping else pending)
                next_traces = time.monotonic() + TRACE_FLUSH_S
            if stopping:
                break
            if time.monotonic() >= next_metrics:
                self._send_metrics()
                next_metrics = time.monotonic() + self._metric_interval_s
        if self._metric_exporter is not None:
            with self._lock:
                if self._giving_up:
                    return
            if self._send_metrics():
                with self._lock:
                    self._final_metrics_done = True

    def _full_batch_ready(self) -> bool:
        with self._lock:
            return self._pending_spans >= MAX_BATCH_SPANS

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

    def _send_spans(self, steps: int | None) -> None:
        """Export the first ``steps`` queued steps (all with None) in batches."""
        exporter = self._span_exporter
        assert exporter is not None
        left = steps
        while left is None or left > 0:
            batch: list[tuple[StepSeen, str]] = []
            n_spans = 0
            with self._lock:
                if self._giving_up or self._abandoned:
                    return
                while self._pending and (left is None or left > 0):
                    n = span_count(self._pending[0][0])
                    if batch and n_spans + n > MAX_BATCH_SPANS:
                        break
                    batch.append(self._pending.popleft())
                    n_spans += n
                    if left is not None:
                        left -= 1
                if not batch:
                    return
                self._pending_spans -= n_spans
                self._in_flight_spans = n_spans
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
            with self._lock:
                if self._abandoned:
                    return
                self._in_flight_spans = 0
                if ok:
                    self.spans_exported += n_spans
                else:
                    self.spans_failed += n_spans
            if not ok:
                self._report_failure(list(self._sdk_log.messages), exporter)

    def _send_metrics(self) -> bool:
        exporter = self._metric_exporter
        assert exporter is not None
        monitoring = self._monitoring
        data = build_metrics_data(
            monitoring.families(),
            self._resource(),
            self._scope,
            self._start_ns,
            time.time_ns(),
        )
        with self._lock:
            if self._giving_up or self._abandoned:
                return False
            self._metrics_in_flight = True
        self._sdk_log.messages.clear()
        try:
            ok = exporter.export(data) == MetricExportResult.SUCCESS
        except Exception:
            _log.debug("otlp: metric export raised", exc_info=True)
            ok = False
        with self._lock:
            if self._abandoned:
                return False
            self._metrics_in_flight = False
            if ok:
                self.metric_exports += 1
            else:
                self.metric_exports_failed += 1
        if not ok:
            self._report_failure(list(self._sdk_log.messages), exporter)
        return ok

    def _report_failure(
        self, messages: Sequence[str] | str, exporter: object | None = None
    ) -> None:
        """Say once, in one line, that exports fail and why."""
        with self._lock:
            if self._failure_reported:
                return
            self._failure_reported = True
        where = endpoint_of(exporter) if exporter is not None else "the OTLP endpoint"
        if isinstance(messages, str):
            reason = messages
        else:
            reason = failure_reason(messages, getattr(exporter, "_endpoint", None))
        self._monitoring.report(
            f"traceml: otlp: export to {where} failed ({reason}); training and the files "
            "go on, and what the live export loses is counted in aggregator/stats.json"
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
