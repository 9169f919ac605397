"""The OTLP sink's configuration, from the standard ``OTEL_*`` variables only: which
signals are on, the metric interval, HTTP or gRPC per signal, the SDK's exporters as
those variables configure them, and the header variables the SDK would ignore in part.
A bad value is a :class:`~traceml_ai.monitor.SinkStartError` (one line), said when the
run starts rather than at the first export."""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from typing import TypeVar

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import SpanExporter

from traceml_ai.monitor._sink import SinkStartError

__all__ = [
    "DEFAULT_METRIC_INTERVAL_MS",
    "endpoint_of",
    "endpoint_problem",
    "header_problems",
    "make_metric_exporter",
    "make_span_exporter",
    "metric_interval_s",
    "signal_on",
]

DEFAULT_METRIC_INTERVAL_MS = 60000.0
"""The SDK's default for ``OTEL_METRIC_EXPORT_INTERVAL``."""

_E = TypeVar("_E", SpanExporter, MetricExporter)

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


_GRPC_TARGET = re.compile(r"(?:[A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}")
"""``host:port``, which the SDK's gRPC exporters take as well as a URL."""


def endpoint_problem(value: str, *, grpc: bool) -> str | None:
    """What is wrong with an ``OTEL_EXPORTER_OTLP_*ENDPOINT`` value, or None.

    The SDK takes any text and fails only when it exports (an HTTP library's error on
    every attempt, or a gRPC channel that never connects): a mistyped endpoint would
    show as export failures, far from its cause."""
    expected = "http://HOST:PORT or https://HOST:PORT" + (" (or HOST:PORT)" if grpc else "")
    if grpc and _GRPC_TARGET.fullmatch(value):
        return None
    try:
        parts = urllib.parse.urlsplit(value)
        port_ok = parts.port is None or parts.port > 0
    except ValueError:
        return f"is not a URL (expected {expected})"
    if parts.scheme.lower() not in ("http", "https") or value != value.strip():
        return f"is not a URL (expected {expected})"
    if not parts.hostname:
        return f"has no host (expected {expected})"
    if not port_ok:
        return f"has no valid port (expected {expected})"
    return None


def _check_endpoint(signal: str, protocol: str) -> None:
    """The endpoint variable the SDK reads for ``signal`` (the signal's own, else the
    base one; an empty one counts as unset, as the SDK does) must be a URL."""
    for var in (f"OTEL_EXPORTER_OTLP_{signal}_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"):
        raw = os.environ.get(var)
        if not raw:
            continue
        problem = endpoint_problem(raw, grpc=protocol == "grpc")
        if problem is not None:
            raise SinkStartError(f"{var}={raw[:200]!r} {problem}")
        return


def signal_on(signal: str) -> bool:
    """``OTEL_TRACES_EXPORTER`` / ``OTEL_METRICS_EXPORTER`` = ``none`` turns a signal off."""
    raw = os.environ.get(f"OTEL_{signal}_EXPORTER", "")
    return raw.strip().lower() != "none"


def metric_interval_s() -> float:
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


def make_span_exporter() -> SpanExporter:
    protocol = _protocol("TRACES")
    _check_endpoint("TRACES", protocol)
    if protocol == "grpc":
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcSpanExporter,
            )
        except ImportError:
            raise _grpc_missing("traces") from None
        return _construct("traces", GrpcSpanExporter)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return _construct("traces", OTLPSpanExporter)


def make_metric_exporter() -> MetricExporter:
    protocol = _protocol("METRICS")
    _check_endpoint("METRICS", protocol)
    if protocol == "grpc":
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


def endpoint_of(exporter: object) -> str:
    value = getattr(exporter, "_endpoint", None)
    return str(value) if value else "the OTLP endpoint"


_HEADER_VARIABLES = (
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_EXPORTER_OTLP_TRACES_HEADERS",
    "OTEL_EXPORTER_OTLP_METRICS_HEADERS",
)


def header_problems(environ: Mapping[str, str]) -> list[str]:
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
