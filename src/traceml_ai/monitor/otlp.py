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
"""

from __future__ import annotations

import logging
import math
import os
import random
import socket
import threading
import time
import urllib.parse
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeVar, cast

import attrs
from opentelemetry.sdk.metrics.export import (
    AggregationTemporality,
    Gauge,
    HistogramDataPoint,
    Metric,
    MetricExporter,
    MetricExportResult,
    MetricsData,
    NumberDataPoint,
    ResourceMetrics,
    ScopeMetrics,
    Sum,
)
from opentelemetry.sdk.metrics.export import Histogram as OtelHistogram
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, TraceFlags
from opentelemetry.util.types import AttributeValue

from traceml_ai.monitor._service import SinkStartError
from traceml_ai.monitor._state import OTHER_PHASE, StepSeen
from traceml_ai.monitor.metrics import Family, collect, otlp_name
from traceml_ai.run_summary._phases import BUILT_IN_PHASES

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
DEFAULT_METRIC_INTERVAL_MS = 60000.0
"""The SDK's default for ``OTEL_METRIC_EXPORT_INTERVAL``."""

SLOW_WINDOW = 32
"""Recent step times of each rank the slow-step rule compares against."""
SLOW_MIN_SEEN = 8
"""Steps of a rank seen before the slow-step rule applies."""
SLOW_FACTOR = 2.0
"""A step slower than this many times its rank's recent median is always traced."""

STEP_SPAN = "traceml.step"
PERIODIC = "periodic"
SLOW = "slow"

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_E = TypeVar("_E", SpanExporter, MetricExporter)
_SCOPE_NAME = "traceml_ai"


# -- sampling ----------------------------------------------------------------------


class StepSampler:
    """Which steps become traces: per rank, steps 1, N+1, 2N+1 ... (the same steps on
    every rank, so that one step can be compared across ranks), plus every step slower
    than ``SLOW_FACTOR`` times the median of its rank's previous ``SLOW_WINDOW`` steps
    (sampled or not), once ``SLOW_MIN_SEEN`` of them have been seen.

    Runs on the feed thread; the cost per step is a modulo and, for steps not already
    picked, the median of a short window.
    """

    def __init__(self, every: int) -> None:
        self.every = max(1, every)
        self._recent: dict[int, deque[float]] = {}

    def pick(self, steps: Iterable[StepSeen]) -> list[tuple[StepSeen, str]]:
        """The steps to trace, each with why (``periodic`` or ``slow``)."""
        picked: list[tuple[StepSeen, str]] = []
        every = self.every
        for step in steps:
            recent = self._recent.get(step.rank)
            if recent is None:
                recent = self._recent[step.rank] = deque(maxlen=SLOW_WINDOW)
            if every == 1 or (step.step - 1) % every == 0:
                picked.append((step, PERIODIC))
            elif len(recent) >= SLOW_MIN_SEEN:
                ordered = sorted(recent)
                n = len(ordered)
                median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
                if step.step_ms > SLOW_FACTOR * median:
                    picked.append((step, SLOW))
            recent.append(step.step_ms)
        return picked


# -- spans -------------------------------------------------------------------------


@attrs.frozen(slots=True)
class PhaseSpan:
    """Where one phase is drawn in its step's trace (Unix ns)."""

    name: str
    start_ns: int
    end_ns: int


def _phase_order(phases: Mapping[str, float]) -> list[str]:
    built_in = [name for name in BUILT_IN_PHASES if name in phases]
    user = sorted(name for name in phases if name not in BUILT_IN_PHASES and name != OTHER_PHASE)
    tail = [OTHER_PHASE] if OTHER_PHASE in phases else []
    return built_in + user + tail


def layout_phases(step: StepSeen) -> list[PhaseSpan]:
    """The step's phases laid end to end in step order from the step's start.

    The step occupies ``[end_ns - step_ms, end_ns]``. Phases are measured as
    durations only, so their positions are a layout: dataloader_wait, h2d, forward,
    backward, optimizer, the user phases (by name), other. When the built-in phases
    add up to more than the step, the batch was fetched before the step opened, so
    dataloader_wait is drawn just before the step's start instead.
    """
    step_ns = round(step.step_ms * 1e6)
    start = step.end_ns - step_ns
    phases = step.phases
    built_in_ms = sum(phases[name] for name in BUILT_IN_PHASES if name in phases)
    before = "dataloader_wait" in phases and built_in_ms > step.step_ms
    out: list[PhaseSpan] = []
    cursor = start
    for name in _phase_order(phases):
        ns = round(phases[name] * 1e6)
        if before and name == "dataloader_wait":
            out.append(PhaseSpan(name, start - ns, start))
            continue
        out.append(PhaseSpan(name, cursor, cursor + ns))
        cursor += ns
    return out


class _SpanBuilder:
    """Finished spans of sampled steps, with random ids."""

    def __init__(self, scope: InstrumentationScope) -> None:
        self._scope = scope
        self._rng = random.Random()

    def _id(self, bits: int) -> int:
        while True:
            value = self._rng.getrandbits(bits)
            if value:
                return value

    def spans(self, step: StepSeen, reason: str, resource: Resource) -> list[ReadableSpan]:
        trace_id = self._id(128)
        root = SpanContext(trace_id, self._id(64), is_remote=False, trace_flags=_SAMPLED)
        start = step.end_ns - round(step.step_ms * 1e6)
        root_attributes: dict[str, AttributeValue] = {
            "traceml.rank": step.rank,
            "traceml.node": step.node,
            "traceml.step": step.step,
            "traceml.sample_reason": reason,
        }
        out = [
            ReadableSpan(
                name=STEP_SPAN,
                context=root,
                parent=None,
                resource=resource,
                attributes=root_attributes,
                kind=SpanKind.INTERNAL,
                start_time=start,
                end_time=step.end_ns,
                instrumentation_scope=self._scope,
            )
        ]
        for phase in layout_phases(step):
            context = SpanContext(trace_id, self._id(64), is_remote=False, trace_flags=_SAMPLED)
            out.append(
                ReadableSpan(
                    name=phase.name,
                    context=context,
                    parent=root,
                    resource=resource,
                    attributes={"traceml.phase": phase.name},
                    kind=SpanKind.INTERNAL,
                    start_time=phase.start_ns,
                    end_time=phase.end_ns,
                    instrumentation_scope=self._scope,
                )
            )
        return out


def _span_count(step: StepSeen) -> int:
    return 1 + len(step.phases)


# -- metrics -----------------------------------------------------------------------


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


# -- the SDK's log messages ----------------------------------------------------------


class _SdkLog(logging.Handler):
    """Takes the OpenTelemetry SDK's log records off the terminal: the exporters log a
    warning per retry and an error per failed export, with tracebacks for some. They go
    to this module's logger at debug level; the latest few are kept so that the one
    failure line can say why."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: deque[str] = deque(maxlen=8)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:
            message = str(record.msg)
        if record.levelno >= logging.WARNING:
            self.messages.append(message)
        _log.debug("opentelemetry: %s", message)


_sdk_log: _SdkLog | None = None
_sdk_log_lock = threading.Lock()


def _quiet_sdk_logs() -> _SdkLog:
    """Route the ``opentelemetry`` loggers to :class:`_SdkLog` (once per process: the
    aggregator is its own process, and an abandoned export thread may still log after
    the sink closed)."""
    global _sdk_log
    with _sdk_log_lock:
        if _sdk_log is None:
            _sdk_log = _SdkLog()
            logger = logging.getLogger("opentelemetry")
            logger.addHandler(_sdk_log)
            logger.propagate = False
        return _sdk_log


def _reason(messages: Sequence[str], endpoint: str | None = None) -> str:
    """A short cause of a failed export: from the SDK's messages, else (its last message
    after retries names no cause) from one connection attempt to the endpoint."""
    text = " ".join(messages)
    lowered = text.lower()
    for needle, reason in (
        ("connection refused", "connection refused"),
        ("read timed out", "timed out"),
        ("timed out", "timed out"),
        ("deadline_exceeded", "timed out"),
        ("unavailable", "receiver unavailable"),
        ("name or service not known", "unknown host"),
        ("nodename nor servname", "unknown host"),
        ("connection reset", "connection reset"),
        ("remotedisconnected", "connection closed by the receiver"),
        ("connection aborted", "connection closed by the receiver"),
    ):
        if needle in lowered:
            return reason
    for message in messages:
        marker = "code: "
        if marker in message:
            code = message.split(marker, 1)[1].split(",", 1)[0].strip()
            if code.isdigit():
                return f"HTTP {code}"
    probed = _probe(endpoint) if endpoint else None
    if probed is not None:
        return probed
    first = messages[0].strip().splitlines() if messages else []
    return first[0][:160] if first else "the exporter gave no reason"


def _probe(endpoint: str) -> str | None:
    """Why a TCP connection to the endpoint fails, or None when it succeeds (then the
    receiver answered too slowly or wrongly). Runs once, on the export thread."""
    url = endpoint if "://" in endpoint else "http://" + endpoint
    try:
        parts = urllib.parse.urlsplit(url)
        host = parts.hostname
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return None
    if not host:
        return None
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return None
    except socket.gaierror:
        return "unknown host"
    except ConnectionRefusedError:
        return "connection refused"
    except TimeoutError:
        return "no answer from the receiver's host"
    except OSError as exc:
        return (exc.strerror or str(exc)).lower()[:80]


# -- configuration -----------------------------------------------------------------

_PROTOCOLS = ("http/protobuf", "grpc")


def _protocol(signal: str) -> str:
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        raw = os.environ.get(var)
        if raw is None or not raw.strip():
            continue
        value = raw.strip().lower()
        if value not in _PROTOCOLS:
            raise SinkStartError(
                f"{var}={raw!r} is not supported: use http/protobuf (the default) or grpc"
            )
        return value
    return "http/protobuf"


def _signal_on(signal: str) -> bool:
    """``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` = ``none`` turns a signal off."""
    raw = os.environ.get(f"OTEL_{signal}_EXPORTER", "")
    return raw.strip().lower() != "none"


def _metric_interval_s() -> float:
    raw = os.environ.get("OTEL_METRIC_EXPORT_INTERVAL")
    if raw is None or not raw.strip():
        return DEFAULT_METRIC_INTERVAL_MS / 1000.0
    try:
        ms = float(raw)
    except ValueError:
        ms = -1.0
    if not math.isfinite(ms) or ms <= 0:
        raise SinkStartError(
            f"OTEL_METRIC_EXPORT_INTERVAL={raw!r} is not a positive number of milliseconds"
        )
    return ms / 1000.0


def _grpc_missing(signal: str) -> SinkStartError:
    return SinkStartError(
        f"OTLP over gRPC for {signal} needs opentelemetry-exporter-otlp-proto-grpc "
        "(pip install 'traceml-ai[otel]'), or set OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf"
    )


def _span_exporter() -> SpanExporter:
    if _protocol("TRACES") == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            raise _grpc_missing("traces") from None
        return _construct("traces", GrpcSpanExporter)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return _construct("traces", OTLPSpanExporter)


def _metric_exporter() -> MetricExporter:
    if _protocol("METRICS") == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
                OTLPMetricExporter as GrpcMetricExporter,
            )
        except ImportError:
            raise _grpc_missing("metrics") from None
        return _construct("metrics", GrpcMetricExporter)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

    return _construct("metrics", OTLPMetricExporter)


def _construct(signal: str, cls: type[_E]) -> _E:
    """The exporter as the ``OTEL_*`` variables configure it (it reads them itself)."""
    try:
        return cls()
    except Exception as exc:
        raise SinkStartError(
            f"cannot set up the {signal} exporter from the OTEL_* variables "
            f"({type(exc).__name__}: {exc})"
        ) from None


def _endpoint(exporter: object) -> str:
    value = getattr(exporter, "_endpoint", None)
    return str(value) if value else "the OTLP endpoint"


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
        sdk_log: _SdkLog | None = None,
    ) -> None:
        self._monitoring = monitoring
        self._span_exporter = span_exporter
        self._metric_exporter = metric_exporter
        self._metric_interval_s = metric_interval_s
        self.sampler = StepSampler(sample_every)
        self._sdk_log = sdk_log or _quiet_sdk_logs()
        run = monitoring.run
        self._base_attributes: dict[str, AttributeValue] = {
            "service.name": "traceml",
            "traceml.run.name": run.run_name,
            "host.name": run.host,
        }
        self._resource_for: tuple[int | None, Resource] | None = None
        self._scope = InstrumentationScope(_SCOPE_NAME, _traceml_version())
        self._builder = _SpanBuilder(self._scope)
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
                n = _span_count(step)
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
                    n = _span_count(self._pending[0][0])
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
            collect(monitoring.state, monitoring.health()),
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
        where = _endpoint(exporter) if exporter is not None else "the OTLP endpoint"
        if isinstance(messages, str):
            reason = messages
        else:
            reason = _reason(messages, getattr(exporter, "_endpoint", None))
        self._monitoring.report(
            f"traceml: otlp: export to {where} failed ({reason}); training and the files "
            "go on, and what the live export loses is counted in aggregator/stats.json"
        )


def _traceml_version() -> str:
    try:
        from importlib.metadata import version

        return version("traceml-ai")
    except Exception:
        return "unknown"


def start_otlp(monitoring: Monitoring) -> OtlpSink:
    """Start the OTLP export the ``OTEL_*`` variables describe; one line says where."""
    traces = _signal_on("TRACES")
    metrics = _signal_on("METRICS")
    interval_s = _metric_interval_s() if metrics else DEFAULT_METRIC_INTERVAL_MS / 1000.0
    sdk_log = _quiet_sdk_logs()
    span_exporter = _span_exporter() if traces else None
    try:
        metric_exporter = _metric_exporter() if metrics else None
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
        parts.append(f"traces ({which}) to {_endpoint(span_exporter)}")
    if metric_exporter is not None:
        parts.append(f"metrics every {interval_s:g} s to {_endpoint(metric_exporter)}")
    monitoring.report(
        "traceml: otlp: " + ("; ".join(parts) if parts else "OTEL_*_EXPORTER=none: nothing to send")
    )
    for line in _header_problems(os.environ):
        monitoring.report(line)
    return sink


_HEADER_VARIABLES = (
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
)


def _header_problems(environ: Mapping[str, str]) -> list[str]:
    """One line per ``OTEL_*_HEADERS`` variable the SDK would ignore in part (it skips a
    malformed entry silently: a mistyped API key header would only show as refusals)."""
    lines: list[str] = []
    for name in _HEADER_VARIABLES:
        value = environ.get(name)
        if not value or not value.strip():
            continue
        bad = [
            part.strip()
            for part in value.split(",")
            if part.strip() and ("=" not in part or not part.split("=", 1)[0].strip())
        ]
        if bad:
            shown = ", ".join(repr(b[:40]) for b in bad[:3])
            lines.append(
                f"traceml: otlp: {name} is not a comma-separated list of name=value "
                f"(the exporter ignores {shown})"
            )
    return lines
