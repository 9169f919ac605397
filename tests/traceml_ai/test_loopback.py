"""The Host rule of the HTTP servers: on a loopback address, only loopback Host names
are answered (the dashboard and /metrics alike, over real sockets)."""

from __future__ import annotations

import http.client
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import pytest

from traceml_ai._loopback import host_allowed, is_loopback

ANSWERED = ["127.0.0.1", "localhost", "127.0.0.1:9464", "LOCALHOST:1", "[::1]:9464", "a.localhost"]
REFUSED = ["evil.example", "evil.example:9464", "10.0.0.1", "", "127.0.0.1.evil.example", "[::2]"]


@pytest.mark.parametrize("header", ANSWERED)
def test_loopback_names_are_answered(header: str) -> None:
    assert host_allowed(header, loopback_only=True)


@pytest.mark.parametrize("header", REFUSED)
def test_other_names_are_refused_on_loopback(header: str) -> None:
    assert not host_allowed(header, loopback_only=True)
    assert host_allowed(header, loopback_only=False)  # listening elsewhere: any name


def test_no_host_header_is_refused_on_loopback() -> None:
    assert not host_allowed(None, loopback_only=True)


def test_bind_hosts() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("")


def _status(port: int, path: str, host: str | None) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest("GET", path, skip_host=True)
        if host is not None:
            conn.putheader("Host", host)
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


@contextmanager
def _dashboard(tmp_path: Path) -> Iterator[tuple[int, str]]:
    from traceml_ai.dashboard._files import FilesSource
    from traceml_ai.dashboard._server import Views, start_server

    server = start_server(Views(FilesSource(tmp_path), final=lambda: False), "127.0.0.1", 0)
    try:
        yield server.port, "/"
    finally:
        server.stop(2.0)


@contextmanager
def _metrics(tmp_path: Path) -> Iterator[tuple[int, str]]:
    from traceml_ai.monitor import RunInfo, prometheus_sink, start_monitoring
    from traceml_ai.monitor.metrics import Health
    from traceml_ai.settings import MonitorSettings

    monitoring = start_monitoring(
        MonitorSettings(prometheus_port=0),
        RunInfo(run_dir=tmp_path, run_name="r", host="h"),
        Health,
        sinks={"prometheus": prometheus_sink},
        report=lambda line: None,
    )
    assert monitoring is not None and monitoring.sinks, monitoring and monitoring.not_started
    try:
        yield monitoring.sinks[0].port, "/metrics"  # type: ignore[attr-defined]
    finally:
        monitoring.close(2.0)


SERVERS: dict[str, Callable[[Path], AbstractContextManager[tuple[int, str]]]] = {
    "dashboard": _dashboard
}


@pytest.mark.parametrize("server", sorted(SERVERS))
def test_both_servers_follow_the_rule(server: str, tmp_path: Path) -> None:
    with SERVERS[server](tmp_path) as (port, path):
        for host in ("127.0.0.1", f"127.0.0.1:{port}", f"localhost:{port}", f"[::1]:{port}"):
            assert _status(port, path, host) == 200, host
        for host in ("evil.example", f"evil.example:{port}", f"10.0.0.1:{port}"):
            assert _status(port, path, host) == 403, host
        assert _status(port, path, None) in (400, 403)  # HTTP/1.1 without a Host
