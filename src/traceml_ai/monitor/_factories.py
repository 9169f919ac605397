"""This package's own sink factories: each imports its sink (and its libraries) only
when called, so that :mod:`~traceml_ai.monitor._service` never imports a sink."""

from __future__ import annotations

from typing import TYPE_CHECKING

from traceml_ai.monitor._sink import LiveSink, extra_required

if TYPE_CHECKING:
    from traceml_ai.monitor._service import Monitoring

__all__ = ["otlp_sink", "prometheus_sink"]


def prometheus_sink(monitoring: Monitoring) -> LiveSink:
    """The ``/metrics`` endpoint (the standard library's HTTP server; no extra)."""
    from traceml_ai.monitor.prometheus import start_prometheus

    return start_prometheus(monitoring)


def otlp_sink(monitoring: Monitoring) -> LiveSink:
    """The OTLP export (the ``otel`` extra, imported only here)."""
    with extra_required("otel"):
        from traceml_ai.monitor.otlp import start_otlp
    return start_otlp(monitoring)
