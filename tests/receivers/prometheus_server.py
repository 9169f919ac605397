"""A real Prometheus server for the tests: Debian's ``/usr/bin/prometheus`` (2.42).

:func:`prometheus_server` starts one on a free loopback port with a generated
configuration (one scrape job, static targets given by the test, a short scrape
interval) and its own storage in a temporary folder, waits until it is ready and
kills it at the end. :class:`PrometheusServer` asks it questions through its HTTP
API (``/api/v1/query``, ``/api/v1/query_range``, ``/api/v1/targets``), each bounded
in time.

A target that goes away leaves its series stale: an instant query at "now" after the
run finds nothing. Ask with ``at=`` a moment inside the run, or through a range
(``last_over_time(x[2m])``, ``max_over_time``): range selectors skip the staleness
markers and return the last scraped values.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import orjson

__all__ = [
    "PROMETHEUS",
    "PrometheusError",
    "PrometheusServer",
    "prometheus_server",
    "scrape_config",
]

PROMETHEUS = os.environ.get("TRACEML_TEST_PROMETHEUS", "/usr/bin/prometheus")
"""The server binary (Debian's ``prometheus`` package; .ci/run installs it)."""

START_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 10.0


class PrometheusError(AssertionError):
    """The server did not start, or answered a query with an error."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape_config(
    targets: Sequence[str], *, job: str = "traceml", scrape_interval_s: float = 0.5
) -> str:
    """The server's configuration: one job scraping ``targets`` (``host:port``) at
    ``/metrics`` every ``scrape_interval_s``. JSON is YAML, so it is written as JSON."""
    interval = f"{round(scrape_interval_s * 1000)}ms"
    config = {
        "global": {"scrape_interval": interval, "scrape_timeout": interval},
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": list(targets)}],
            }
        ],
    }
    return orjson.dumps(config, option=orjson.OPT_INDENT_2).decode()


class PrometheusServer:
    """A running server: its address and the HTTP API's answers."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        """``http://127.0.0.1:PORT``"""
        self.process = process
        self.log = log

    # -- the HTTP API ------------------------------------------------------------------

    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        try:
            with urllib.request.urlopen(self.url + path + query, timeout=REQUEST_TIMEOUT_S) as r:
                body = orjson.loads(r.read())
        except urllib.error.HTTPError as exc:
            # The API answers bad queries with 400/422 and a JSON error.
            raise PrometheusError(f"{path} {params}: {exc.code} {exc.read()[:500]!r}") from None
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query's vector: ``[{"metric": {labels}, "value": [t, "v"]}, ...]``,
        evaluated now or at Unix time ``at``."""
        params = {"query": expr}
        if at is not None:
            params["time"] = f"{at:.3f}"
        data = self._get("/api/v1/query", params)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        if data["resultType"] != "vector":
            raise PrometheusError(f"{expr}: a {data['resultType']}, not a vector")
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(
        self, expr: str, start: float, end: float, step_s: float = 0.5
    ) -> list[dict[str, Any]]:
        """A range query's matrix: ``[{"metric": {labels}, "values": [[t, "v"], ...]}]``."""
        data = self._get(
            "/api/v1/query_range",
            {"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s}"},
        )
        result: list[dict[str, Any]] = data["result"]
        return result

    def samples(self, selector: str, window: str = "10m") -> list[dict[str, Any]]:
        """The raw scraped samples of ``selector`` over the last ``window``, each series'
        ``values`` as ``[[scrape time, "v"], ...]`` (staleness markers left out)."""
        data = self._get("/api/v1/query", {"query": f"{selector}[{window}]"})
        if data["resultType"] != "matrix":
            raise PrometheusError(f"{selector}: a {data['resultType']}, not a matrix")
        result: list[dict[str, Any]] = data["result"]
        return result

    def values(self, expr: str, by: str, at: float | None = None) -> dict[str, float]:
        """An instant query's values keyed by the label ``by`` (one series per value)."""
        out: dict[str, float] = {}
        for series in self.query(expr, at):
            key = series["metric"].get(by, "")
            assert key not in out, f"{expr}: two series with {by}={key!r}"
            out[key] = float(series["value"][1])
        return out

    def value(self, expr: str, at: float | None = None) -> float | None:
        """An instant query's one value (None when it returns nothing)."""
        result = self.query(expr, at)
        if not result:
            return None
        assert len(result) == 1, f"{expr}: {len(result)} series"
        return float(result[0]["value"][1])

    def targets(self) -> list[dict[str, Any]]:
        """The active targets (``health``, ``lastScrape``, ``lastError``, ``scrapeUrl`` ...)."""
        data = self._get("/api/v1/targets", {"state": "active"})
        active: list[dict[str, Any]] = data["activeTargets"]
        return active

    def wait_for(self, expr: str, *, timeout_s: float, poll_s: float = 0.2) -> list[dict[str, Any]]:
        """Poll an instant query until it returns something; fail after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(
                    f"nothing for {expr} after {timeout_s} s; targets: {self.targets()}"
                )
            time.sleep(poll_s)

    def wait_for_targets(self, *, timeout_s: float = 15.0) -> list[dict[str, Any]]:
        """Wait until the server knows its targets: its discovery hands them over a few
        seconds (up to 5) after the start, and only then scraping begins."""
        deadline = time.monotonic() + timeout_s
        while not (targets := self.targets()):
            if time.monotonic() > deadline:
                raise PrometheusError(f"no targets after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.1)
        return targets

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=1.0) as r:
            return int(r.status) == 200
    except (OSError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def prometheus_server(
    targets: Sequence[str],
    *,
    job: str = "traceml",
    scrape_interval_s: float = 0.5,
    folder: Path | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Iterator[PrometheusServer]:
    """A Prometheus server scraping ``targets`` (``host:port`` each), ready to query.

    Its configuration, storage and log live in ``folder`` (a temporary folder,
    removed afterwards, when not given). The server is killed on the way out.
    """
    if not os.access(PROMETHEUS, os.X_OK):
        raise PrometheusError(
            f"{PROMETHEUS} not found: install Debian's prometheus package (.ci/run does)"
        )
    owned = folder is None
    base = Path(tempfile.mkdtemp(prefix="traceml-prom-")) if folder is None else folder
    base.mkdir(parents=True, exist_ok=True)
    config = base / "prometheus.yml"
    config.write_text(scrape_config(targets, job=job, scrape_interval_s=scrape_interval_s))
    log = base / "prometheus.log"
    process: subprocess.Popen[bytes] | None = None
    try:
        # The port is free when chosen; another process may take it before the server
        # binds: then the server exits and the next port is tried.
        for _attempt in range(3):
            port = _free_port()
            url = f"http://127.0.0.1:{port}"
            with log.open("ab") as out:
                process = subprocess.Popen(
                    [
                        PROMETHEUS,
                        f"--config.file={config}",
                        f"--storage.tsdb.path={base / 'data'}",
                        f"--web.listen-address=127.0.0.1:{port}",
                        "--storage.tsdb.retention.time=1h",
                        "--log.level=warn",
                    ],
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    cwd=base,
                    start_new_session=True,
                )
            deadline = time.monotonic() + start_timeout_s
            while process.poll() is None and not _ready(url):
                if time.monotonic() > deadline:
                    raise PrometheusError(
                        f"prometheus not ready after {start_timeout_s} s:\n"
                        + log.read_text(errors="replace")[-4000:]
                    )
                time.sleep(0.05)
            if process.poll() is None:
                break
        else:
            raise PrometheusError(
                "prometheus exited at start:\n" + log.read_text(errors="replace")[-4000:]
            )
        yield PrometheusServer(url, process, log)
    finally:
        if process is not None and process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait(timeout=10)
        if owned:
            shutil.rmtree(base, ignore_errors=True)
