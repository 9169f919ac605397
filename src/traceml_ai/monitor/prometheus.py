"""The Prometheus endpoint: ``/metrics`` on the aggregator, from the live state.

Each scrape writes :meth:`~traceml_ai.monitor.Monitoring.families` in Prometheus' text
format (version 0.0.4), so a scrape costs the aggregator work only when Prometheus
asks, and the receive loop never waits for one. The text is written here rather than
by a client library: a 1,024-rank scrape has tens of thousands of lines, and a
formatter that builds an object per sample and sorts each one's labels takes several
times as long (docs/benchmarks.md).

The standard library's threaded HTTP server answers, one thread per request. It
serves ``/metrics`` and nothing else (404), follows the dashboard's Host rule on a
loopback address (``traceml_ai._loopback``: 403 for a foreign name), and prints
nothing into the training terminal, whatever a client sends.
"""

from __future__ import annotations

import functools
import gzip
import http.server
import logging
import math
import socket
import threading
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from traceml_ai._listen import listen_first
from traceml_ai._loopback import host_allowed, is_loopback
from traceml_ai.monitor._sink import SinkStartError
from traceml_ai.monitor._state import StepSeen
from traceml_ai.monitor.metrics import Family

if TYPE_CHECKING:
    from traceml_ai.monitor._service import Monitoring

__all__ = ["CONTENT_TYPE", "PATH", "PrometheusSink", "exposition", "start_prometheus"]

_log = logging.getLogger("traceml_ai.monitor")

PATH = "/metrics"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REQUEST_TIMEOUT_S = 10.0
"""A client that sends its request no faster than this is dropped (its thread ends)."""
_GZIP_LEVEL = 1
"""Prometheus asks for gzip; level 1 takes most of the size off for little CPU."""


# -- the text format ------------------------------------------------------------------


def _escape_label(value: str) -> str:
    if "\\" in value or '"' in value or "\n" in value:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return value


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample value as the format writes it (Go's float syntax)."""
    if type(value) is int:
        return str(value)
    if math.isfinite(value):
        return repr(float(value))
    if math.isnan(value):
        return "NaN"
    return "+Inf" if value > 0 else "-Inf"


def exposition(families: Sequence[Family]) -> str:
    """The families in Prometheus' text format; a family without series is left out."""
    out: list[str] = []
    append = out.append
    # A rank's label pairs recur in every per-rank family: each is written once per
    # scrape, keyed by the label names and then the values.
    written: dict[tuple[str, ...], dict[tuple[str, ...], str]] = {}
    finite, number = math.isfinite, _number

    for family in families:
        if not family.samples:
            continue
        m = family.metric
        name, names = m.name, m.labels
        pairs = written.setdefault(names, {})
        order = _sorted_positions(names)
        append(f"# HELP {name} {_escape_help(m.help)}\n# TYPE {name} {m.kind}\n")
        for sample in family.samples:
            values = sample.labels
            text = pairs.get(values)
            if text is None:
                text = pairs[values] = ",".join(
                    f'{names[i]}="{_escape_label(values[i])}"' for i in order
                )
            hist = sample.histogram
            if hist is None:
                value = sample.value
                shown = repr(value) if type(value) is float and finite(value) else number(value)
                append(f"{name}{{{text}}} {shown}\n" if text else f"{name} {shown}\n")
                continue
            bucket = f'{name}_bucket{{{text}{"," if text else ""}le="'
            cumulative = 0
            for le, count in zip(_les(hist.bounds), hist.counts, strict=True):
                cumulative += count
                append(f'{bucket}{le}"}} {cumulative}\n')
            braces = f"{{{text}}}" if text else ""
            append(f"{name}_sum{braces} {number(hist.total)}\n{name}_count{braces} {hist.n}\n")
    return "".join(out)


@functools.cache
def _sorted_positions(names: tuple[str, ...]) -> tuple[int, ...]:
    """The label names' positions in name order: each series' labels are written
    sorted by name (``le`` last), as client libraries write them."""
    return tuple(sorted(range(len(names)), key=names.__getitem__))


@functools.cache
def _les(bounds: tuple[float, ...]) -> tuple[str, ...]:
    """The ``le`` label values of a histogram's buckets, +Inf last."""
    return (*(repr(float(b)) for b in bounds), "+Inf")


# -- the server -----------------------------------------------------------------------


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    timeout = REQUEST_TIMEOUT_S
    server_version = "traceml"
    sys_version = ""

    def do_GET(self) -> None:
        if not host_allowed(self.headers.get("Host"), loopback_only=self.server.loopback_only):
            self._answer(
                403,
                b"traceml /metrics: this endpoint answers only requests to a loopback "
                b"address (127.0.0.1, localhost)\n",
            )
            return
        if urllib.parse.urlsplit(self.path).path != PATH:
            self._answer(404, b"traceml: not found; the metrics are at /metrics\n")
            return
        try:
            self.server.monitoring.feed.straggler_for_read()
            body = exposition(self.server.monitoring.families()).encode("utf-8", "replace")
        except Exception:  # a bug answers 500; the server and the run go on
            _log.debug("building /metrics failed", exc_info=True)
            self._answer(500, b"traceml /metrics: building the metrics failed\n")
            return
        gzipped = "gzip" in self.headers.get("Accept-Encoding", "")
        if gzipped:
            body = gzip.compress(body, compresslevel=_GZIP_LEVEL)
        self._answer(200, body, CONTENT_TYPE, gzipped=gzipped)

    def _answer(
        self,
        status: int,
        body: bytes,
        kind: str = "text/plain; charset=utf-8",
        *,
        gzipped: bool = False,
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        if gzipped:
            self.send_header("Content-Encoding", "gzip")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Nothing goes to the terminal: anyone who can reach the port could fill it."""
        del format, args


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never holds the aggregator's exit

    def __init__(self, address: tuple[Any, ...], family: int, monitoring: Monitoring) -> None:
        self.address_family = family
        self.monitoring = monitoring
        self.loopback_only = is_loopback(str(address[0]))
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client gone mid-answer, or a bug: logged at debug level, never printed."""
        _log.debug("/metrics request from %s failed", client_address, exc_info=True)


class PrometheusSink:
    """The running endpoint."""

    name = "prometheus"
    straggler_on_demand = True
    """A scrape has the straggler view made when it is older than the feed's period."""

    def __init__(self, server: _Server, thread: threading.Thread, host: str, port: int) -> None:
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
        return f"http://{host}:{self.port}{PATH}"

    def on_steps(self, steps: Sequence[StepSeen]) -> None:
        """Nothing to do: a scrape reads the state."""

    def close(self, timeout_s: float) -> Mapping[str, int]:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout_s)
        return {}


def _bind(host: str, port: int, monitoring: Monitoring) -> _Server:
    return listen_first(
        host,
        port,
        lambda family, address: _Server(address, family, monitoring),
        doing=f"cannot serve {PATH}",
        error=SinkStartError,
    )


def start_prometheus(monitoring: Monitoring) -> PrometheusSink:
    """Serve ``/metrics`` on the configured host and port; one line says where."""
    settings = monitoring.settings
    port = settings.prometheus_port
    assert port is not None
    host = settings.prometheus_bind_host
    server = _bind(host, port, monitoring)
    thread = threading.Thread(
        # Polled for shutdown every 0.1 s: the run's end waits at most that for it.
        target=server.serve_forever,
        kwargs={"poll_interval": 0.1},
        name="traceml-prometheus",
        daemon=True,
    )
    thread.start()
    sink = PrometheusSink(server, thread, host, int(server.server_address[1]))
    monitoring.report(f"traceml: prometheus: metrics at {sink.url}")
    return sink
