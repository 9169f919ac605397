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

from traceml_ai._lazy_names import lazy_surface

TYPE_CHECKING = False
if TYPE_CHECKING:  # the names of _LAZY, for mypy and editors (tests/traceml_ai/test_surfaces.py)
    from traceml_ai.monitor._factories import otlp_sink as otlp_sink
    from traceml_ai.monitor._factories import prometheus_sink as prometheus_sink
    from traceml_ai.monitor._feed import STRAGGLER_PERIOD_S as STRAGGLER_PERIOD_S
    from traceml_ai.monitor._feed import STRAGGLER_STEPS as STRAGGLER_STEPS
    from traceml_ai.monitor._service import Monitoring as Monitoring
    from traceml_ai.monitor._service import SinkFactory as SinkFactory
    from traceml_ai.monitor._service import start_monitoring as start_monitoring
    from traceml_ai.monitor._sink import LiveSink as LiveSink
    from traceml_ai.monitor._sink import RunInfo as RunInfo
    from traceml_ai.monitor._sink import SinkStartError as SinkStartError
    from traceml_ai.monitor._sink import extra_required as extra_required
    from traceml_ai.monitor._state import WINDOW_STEPS as WINDOW_STEPS
    from traceml_ai.monitor._state import LiveState as LiveState
    from traceml_ai.monitor._state import StepSeen as StepSeen
    from traceml_ai.monitor.trackers import tracker_sink as tracker_sink

_LAZY = {
    "traceml_ai.monitor._factories": ("otlp_sink", "prometheus_sink"),
    "traceml_ai.monitor._feed": ("STRAGGLER_PERIOD_S", "STRAGGLER_STEPS"),
    "traceml_ai.monitor._service": ("Monitoring", "SinkFactory", "start_monitoring"),
    "traceml_ai.monitor._sink": ("LiveSink", "RunInfo", "SinkStartError", "extra_required"),
    "traceml_ai.monitor._state": ("WINDOW_STEPS", "LiveState", "StepSeen"),
    "traceml_ai.monitor.trackers": ("tracker_sink",),
}

__all__, __getattr__, __dir__ = lazy_surface(__name__, _LAZY, globals())
