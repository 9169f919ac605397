"""The Prometheus endpoint: its text (read back by prometheus_client's parser and by
Prometheus' own ``promtool``), what it serves and to whom, over real loopback HTTP."""

from __future__ import annotations

import contextlib
import gzip
import http.client
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.custom_exporters import step_memory_item
from tests.traceml_ai.monitor.test_monitor import encoded, families_of, identity, step
from traceml_ai.monitor import Monitoring, RunInfo, prometheus_sink, start_monitoring
from traceml_ai.monitor._state import LiveState
from traceml_ai.monitor.metrics import Health, traceml_version
from traceml_ai.monitor.prometheus import CONTENT_TYPE, exposition
from traceml_ai.settings import MonitorSettings

HOSTILE = 'a "quoted" \\ back\nslash é'
"""A label value with every character the format escapes, and one it does not."""


def _hostile_state() -> LiveState:
    state = LiveState()
    ident = identity(0)
    state.add_steps(ident, [step(1, 20.0, 1, **{HOSTILE: 3.0})])  # a user phase name
    state.add_memory(ident, [step_memory_item(device=HOSTILE[:32])])
    return state


def test_label_values_are_escaped_and_read_back_unchanged() -> None:
    families = families_of(_hostile_state())
    text = exposition(list(families.values()))
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    phases = {s.labels["phase"] for s in parsed["traceml_phase_time_seconds"].samples}
    assert f"user:{HOSTILE}" in phases
    (memory,) = parsed["traceml_step_peak_allocated_bytes"].samples
    assert memory.labels["device"] == HOSTILE[:32]
    # Every series the families hold, and nothing else.
    served = sum(len(f.samples) for f in parsed.values())
    assert served == sum(1 for line in text.splitlines() if not line.startswith("#"))


@pytest.mark.skipif(shutil.which("promtool") is None, reason="Debian's prometheus package")
def test_promtool_accepts_the_text(tmp_path: Path) -> None:
    text = exposition(list(families_of(_hostile_state()).values()))
    result = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""  # no lint either


@contextlib.contextmanager
def _endpoint(
    tmp_path: Path, run_name: str = "r", host: str = "127.0.0.1"
) -> Iterator[tuple[Monitoring, int]]:
    monitoring = start_monitoring(
        MonitorSettings(prometheus_port=0, prometheus_bind_host=host),
        RunInfo(run_dir=tmp_path, run_name=run_name, host="h"),
        lambda: Health(expected_ranks=2),
        sinks={"prometheus": prometheus_sink},
        report=lambda line: None,
    )
    assert monitoring is not None and monitoring.sinks, monitoring and monitoring.not_started
    try:
        yield monitoring, monitoring.sinks[0].port  # type: ignore[attr-defined]
    finally:
        monitoring.close(2.0)


def _get(
    port: int, path: str, host: str | None = "127.0.0.1", **headers: str
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True, skip_accept_encoding=True)
        if host is not None:
            conn.putheader("Host", host)
        for name, value in headers.items():
            conn.putheader(name.replace("_", "-"), value)
        conn.endheaders()
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


@pytest.mark.parametrize(
    "path", ["/", "/metric", "/metricsx", "/metrics/", "/metrics/x", "/favicon.ico", "/api/view"]
)
def test_only_metrics_is_served(tmp_path: Path, path: str) -> None:
    with _endpoint(tmp_path) as (_, port):
        status, _, body = _get(port, path)
        assert status == 404, (path, body[:200])
        assert b"traceml_" not in body
        assert _get(port, "/metrics?anything=1")[0] == 200


def test_the_run_is_named_by_an_info_metric(tmp_path: Path) -> None:
    run = 'train "big" é'
    with _endpoint(tmp_path, run_name=run) as (_, port):
        status, headers, body = _get(port, "/metrics")
    assert status == 200 and headers["Content-Type"] == CONTENT_TYPE
    parsed = {f.name: f for f in text_string_to_metric_families(body.decode())}
    (info,) = parsed["traceml_run_info"].samples
    assert info.labels == {"run": run, "version": traceml_version()} and info.value == 1


def test_gzip_when_asked(tmp_path: Path) -> None:
    with _endpoint(tmp_path) as (monitoring, port):
        monitoring.submit(encoded("step_time", identity(0), [step(1, 12.0, 1)]))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and not any(r.steps for r in monitoring.state.ranks()):
            time.sleep(0.02)
        plain = _get(port, "/metrics")
        zipped = _get(port, "/metrics", Accept_Encoding="gzip")
    assert zipped[1]["Content-Encoding"] == "gzip" and "Content-Encoding" not in plain[1]
    assert gzip.decompress(zipped[2]) == plain[2]
    assert b'traceml_steps_total{rank="0"} 1\n' in plain[2]


def test_listening_everywhere_answers_any_host(tmp_path: Path) -> None:
    with _endpoint(tmp_path, host="0.0.0.0") as (_, port):
        assert _get(port, "/metrics", host="metrics.example:9464")[0] == 200
        assert _get(port, "/", host="metrics.example:9464")[0] == 404


def test_bad_requests_print_nothing_and_the_endpoint_goes_on(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    with _endpoint(tmp_path) as (_, port):
        for garbage in (
            b"\x00\xff garbage\r\n\r\n",
            b"POST /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\n" + b"X: " + b"a" * 100_000 + b"\r\n\r\n",
            b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",  # gone before the answer
        ):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall(garbage)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            conn.settimeout(5)
            with contextlib.suppress(OSError):
                conn.recv(16)
        time.sleep(0.2)
        assert _get(port, "/metrics")[0] == 200
    out, err = capfd.readouterr()
    assert out == "" and err == "", err


def test_a_failing_build_is_a_500_and_the_endpoint_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with _endpoint(tmp_path) as (monitoring, port):

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("a bug")

        monkeypatch.setattr(monitoring, "families", broken)
        assert _get(port, "/metrics")[0] == 500
        monkeypatch.undo()
        assert _get(port, "/metrics")[0] == 200


def test_a_scrape_has_the_straggler_view_made_and_no_period_makes_one(tmp_path: Path) -> None:
    """With Prometheus the only live view, the feed runs no periodic analysis that
    nothing reads: the scrape has it made (on its thread) and serves the straggler."""
    with _endpoint(tmp_path) as (monitoring, port):
        assert monitoring.feed.straggler_on_demand is True
        for rank in (0, 1):
            # Rank 1 spends 30 ms more in forward; rank 0 waits that long in backward.
            fwd, bwd = (35.0, 5.0) if rank == 1 else (5.0, 35.0)
            phases = {"_traceml_internal:forward_time": fwd, "_traceml_internal:backward_time": bwd}
            items = [step(i, 45.0, 10**18 + i * 50_000_000, **phases) for i in range(1, 21)]
            monitoring.submit(encoded("step_time", identity(rank), items))
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and sum(r.steps for r in monitoring.state.ranks()) < 40:
            time.sleep(0.02)
        assert sum(r.steps for r in monitoring.state.ranks()) == 40
        assert monitoring.state.straggler is None  # the feed made none by itself
        status, _, body = _get(port, "/metrics")
        view = monitoring.state.straggler
    assert status == 200
    assert view is not None and view.named_ranks == [1]
    parsed = {f.name: f for f in text_string_to_metric_families(body.decode())}
    (excess,) = parsed["traceml_straggler_excess_seconds"].samples
    assert excess.labels["rank"] == "1" and excess.value == pytest.approx(0.030, abs=0.002)
