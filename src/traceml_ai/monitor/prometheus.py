"""The Prometheus endpoint: ``/metrics`` on the aggregator, from the live state.

A custom collector writes :func:`traceml_ai.monitor.metrics.collect`'s families at
each scrape, so a scrape costs the aggregator work only when Prometheus asks, and the
receive loop never touches prometheus_client. prometheus_client's own threaded HTTP
server answers (one thread per scrape); its registry holds only this collector, so
the endpoint shows the run, not the aggregator process's Python internals.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from traceml_ai.monitor._service import SinkStartError
from traceml_ai.monitor._state import StepSeen
from traceml_ai.monitor.metrics import Family, collect

if TYPE_CHECKING:
    from traceml_ai.monitor._service import Monitoring

__all__ = ["PrometheusSink", "families_to_prometheus", "start_prometheus"]


def _le(bound: float) -> str:
    return "+Inf" if math.isinf(bound) else repr(float(bound))


def families_to_prometheus(families: Sequence[Family]) -> Iterator[Metric]:
    """prometheus_client metric families for :func:`collect`'s families."""
    for family in families:
        m = family.metric
        labels = list(m.labels)
        if m.kind == "histogram":
            hist_family = HistogramMetricFamily(m.name, m.help, labels=labels, unit="")
            for sample in family.samples:
                hist = sample.histogram
                if hist is None:
                    continue
                cumulative = 0
                buckets: list[tuple[str, float]] = []
                for bound, count in zip((*hist.bounds, math.inf), hist.counts, strict=True):
                    cumulative += count
                    buckets.append((_le(bound), float(cumulative)))
                hist_family.add_metric(list(sample.labels), buckets, hist.total)
            yield hist_family
        elif m.kind == "counter":
            counter = CounterMetricFamily(m.name.removesuffix("_total"), m.help, labels=labels)
            for sample in family.samples:
                counter.add_metric(list(sample.labels), sample.value)
            yield counter
        else:
            gauge = GaugeMetricFamily(m.name, m.help, labels=labels)
            for sample in family.samples:
                gauge.add_metric(list(sample.labels), sample.value)
            yield gauge


class _LiveCollector(Collector):
    def __init__(self, monitoring: Monitoring) -> None:
        self._monitoring = monitoring

    def collect(self) -> Iterator[Metric]:
        monitoring = self._monitoring
        yield from families_to_prometheus(collect(monitoring.state, monitoring.health()))


class PrometheusSink:
    """The running endpoint."""

    name = "prometheus"

    def __init__(self, server: Any, thread: threading.Thread, host: str, port: int) -> None:
        self._server = server
        self._thread = thread
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        host = self.host
        if host in ("0.0.0.0", "::", ""):
            # Listening everywhere: name this host, as a scraper elsewhere would.
            host = socket.gethostname()
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/metrics"

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """Nothing to do: a scrape reads the state."""

    def close(self, timeout_s: float) -> Mapping[str, int]:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
        return {}


def start_prometheus(monitoring: Monitoring) -> PrometheusSink:
    """Serve ``/metrics`` on the configured host and port; one line says where."""
    settings = monitoring.settings
    port = settings.prometheus_port
    assert port is not None
    host = settings.prometheus_bind_host
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_LiveCollector(monitoring))
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise SinkStartError(
            f"cannot serve /metrics on {host}:{port}: {exc.strerror or exc}"
        ) from None
    bound_port = int(server.server_address[1])
    sink = PrometheusSink(server, thread, host, bound_port)
    monitoring.report(f"traceml: prometheus: metrics at {sink.url}")
    return sink
