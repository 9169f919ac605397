"""An OTLP/HTTP receiver for the tests: what a collector does with the requests.

:class:`OtlpReceiver` listens on a free loopback port (``http.server`` on a thread),
accepts ``POST /v1/traces`` and ``POST /v1/metrics`` in binary protobuf (gzip or
not), decodes them with the ``opentelemetry-proto`` messages (not with anything of
this project) and keeps them. It can answer slowly (``delay_s``, to exceed the
exporter's timeout) and be stopped mid-run (its port then refuses connections).
"""

from __future__ import annotations

import contextlib
import gzip
import socket
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.metrics.v1.metrics_pb2 import Metric
from opentelemetry.proto.trace.v1.trace_pb2 import Span

__all__ = ["OtlpReceiver", "ReceivedMetric", "ReceivedSpan", "attributes"]


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return attributes(value.kvlist_value.values)
    return getattr(value, kind)


def attributes(pairs: Any) -> dict[str, Any]:
    """OTLP key/value pairs as a dict."""
    out: dict[str, Any] = {}
    for kv in pairs:
        assert isinstance(kv, KeyValue)
        out[kv.key] = _value(kv.value)
    return out


class ReceivedSpan:
    """One received span with its resource's and its own attributes decoded."""

    def __init__(self, span: Span, resource: dict[str, Any], scope: str) -> None:
        self.span = span
        self.resource = resource
        self.scope = scope
        self.name = span.name
        self.trace_id = span.trace_id.hex()
        self.span_id = span.span_id.hex()
        self.parent_id = span.parent_span_id.hex() if span.parent_span_id else None
        self.start_ns = int(span.start_time_unix_nano)
        self.end_ns = int(span.end_time_unix_nano)
        self.attributes = attributes(span.attributes)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


class ReceivedMetric:
    """One metric of one request, with its resource's attributes decoded."""

    def __init__(self, metric: Metric, resource: dict[str, Any], received_at: float) -> None:
        self.metric = metric
        self.resource = resource
        self.received_at = received_at
        self.name = metric.name
        self.kind = metric.WhichOneof("data")


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that gave up (its timeout) leaves a broken pipe: not an error here."""


class OtlpReceiver:
    """A running receiver; ``url`` is its base (set ``OTEL_EXPORTER_OTLP_ENDPOINT`` to it)."""

    def __init__(self, *, delay_s: float = 0.0, status: int = 200) -> None:
        self.delay_s = delay_s
        self.status = status
        self.trace_requests: list[ExportTraceServiceRequest] = []
        self.metric_requests: list[tuple[float, ExportMetricsServiceRequest]] = []
        self.requests = 0
        self.headers: list[dict[str, str]] = []
        self.bad_requests: list[str] = []
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._stopped = False
        self._connections: set[socket.socket] = set()

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Die as a killed receiver does: the listening socket and every open connection
        are closed; from now on connections are refused."""
        if self._stopped:
            return
        self._stopped = True
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            connections = list(self._connections)
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        self._thread.join(5.0)

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def setup(self) -> None:
                super().setup()
                with receiver._lock:
                    receiver._connections.add(self.connection)

            def finish(self) -> None:
                with receiver._lock:
                    receiver._connections.discard(self.connection)
                with contextlib.suppress(OSError):
                    super().finish()

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                encoding = (self.headers.get("Content-Encoding") or "").lower()
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                with receiver._lock:
                    receiver.requests += 1
                    receiver.headers.append({k.lower(): v for k, v in self.headers.items()})
                if receiver.delay_s:
                    time.sleep(receiver.delay_s)
                response: bytes
                if self.path == "/v1/traces":
                    trace_request = ExportTraceServiceRequest()
                    trace_request.ParseFromString(body)
                    with receiver._lock:
                        receiver.trace_requests.append(trace_request)
                    response = ExportTraceServiceResponse().SerializeToString()
                elif self.path == "/v1/metrics":
                    metric_request = ExportMetricsServiceRequest()
                    metric_request.ParseFromString(body)
                    with receiver._lock:
                        receiver.metric_requests.append((time.time(), metric_request))
                    response = ExportMetricsServiceResponse().SerializeToString()
                else:
                    with receiver._lock:
                        receiver.bad_requests.append(self.path)
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                status = receiver.status
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(response)))
                self.end_headers()
                with contextlib.suppress(OSError):
                    self.wfile.write(response)

        return Handler

    # -- what arrived ------------------------------------------------------------------

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            requests = list(self.trace_requests)
        out: list[ReceivedSpan] = []
        for request in requests:
            for rs in request.resource_spans:
                resource = attributes(rs.resource.attributes)
                for ss in rs.scope_spans:
                    for span in ss.spans:
                        out.append(ReceivedSpan(span, resource, ss.scope.name))
        return out

    def metrics(self) -> Iterator[ReceivedMetric]:
        with self._lock:
            requests = list(self.metric_requests)
        for received_at, request in requests:
            for rm in request.resource_metrics:
                resource = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for metric in sm.metrics:
                        yield ReceivedMetric(metric, resource, received_at)

    def latest(self, name: str) -> ReceivedMetric | None:
        """The last received copy of the metric ``name``."""
        found: ReceivedMetric | None = None
        for metric in self.metrics():
            if metric.name == name:
                found = metric
        return found
