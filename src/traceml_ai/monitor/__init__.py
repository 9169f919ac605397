"""The aggregator's live views: what the run looks like now, for Prometheus, OTLP and
the dashboard (docs/monitoring.md).

``metrics`` defines every metric once. This package's names are its surface for the
rest of ``traceml_ai`` (the aggregator that starts monitoring, the dashboard that
serves it); they load on first use (PEP 562), with the state, its feed and the
service. A sink is handed to :func:`start_monitoring` by its caller as a factory
(:data:`SinkFactory`) that imports its libraries only when called: this package's
own, :func:`prometheus_sink` (the standard library's HTTP server),
:func:`otlp_sink` and :func:`tracker_sink` (one per experiment tracker), and the
dashboard's (``traceml_ai.dashboard.start_live_dashboard``). A default install never
imports opentelemetry, the web server or a tracker's library.
"""

from __future__ import annotations

from traceml_ai._lazy_names import lazy_getattr

TYPE_CHECKING = False
if TYPE_CHECKING:
    from traceml_ai.monitor._factories import otlp_sink, prometheus_sink
    from traceml_ai.monitor._feed import STRAGGLER_PERIOD_S, STRAGGLER_STEPS
    from traceml_ai.monitor._service import Monitoring, SinkFactory, start_monitoring
    from traceml_ai.monitor._sink import LiveSink, RunInfo, SinkStartError, extra_required
    from traceml_ai.monitor._state import WINDOW_STEPS, LiveState, StepSeen
    from traceml_ai.monitor.trackers import tracker_sink

_LAZY = {
    **dict.fromkeys(
        ("Monitoring", "SinkFactory", "start_monitoring"), "traceml_ai.monitor._service"
    ),
    **dict.fromkeys(
        ("LiveSink", "RunInfo", "SinkStartError", "extra_required"), "traceml_ai.monitor._sink"
    ),
    **dict.fromkeys(("otlp_sink", "prometheus_sink"), "traceml_ai.monitor._factories"),
    **dict.fromkeys(("WINDOW_STEPS", "LiveState", "StepSeen"), "traceml_ai.monitor._state"),
    **dict.fromkeys(("STRAGGLER_PERIOD_S", "STRAGGLER_STEPS"), "traceml_ai.monitor._feed"),
    "tracker_sink": "traceml_ai.monitor.trackers",
}

__getattr__ = lazy_getattr(__name__, _LAZY, globals())

__all__ = [
    "STRAGGLER_PERIOD_S",
    "STRAGGLER_STEPS",
    "WINDOW_STEPS",
    "LiveSink",
    "LiveState",
    "Monitoring",
    "RunInfo",
    "SinkFactory",
    "SinkStartError",
    "StepSeen",
    "extra_required",
    "otlp_sink",
    "prometheus_sink",
    "start_monitoring",
    "tracker_sink",
]
