"""Edges of the live views found by trying them as an adversary would."""

from __future__ import annotations

import contextlib
import json
import socket
import time
from pathlib import Path

import pytest

from traceml_ai.dashboard._server import Views, start_server
from traceml_ai.launch.launcher import lost_what
from traceml_ai.monitor._otlp_config import endpoint_problem, header_problems


def test_malformed_requests_print_nothing_into_the_terminal(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    from traceml_ai.dashboard._files import FilesSource

    server = start_server(Views(FilesSource(tmp_path), final=lambda: False), "127.0.0.1", 0)
    try:
        for garbage in (
            b"\x00\xff garbage\r\n\r\n",
            b"GET /\r\n\r\n",
            b"GET / HTTP/1.1\r\n" + b"X: " + b"a" * 100_000 + b"\r\n\r\n",
        ):
            with socket.create_connection(("127.0.0.1", server.port), timeout=5) as conn:
                conn.sendall(garbage)
                conn.settimeout(5)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
        time.sleep(0.2)
    finally:
        server.stop(2.0)
    out, err = capfd.readouterr()
    assert "Invalid HTTP request" not in err and out == "", err


@pytest.mark.parametrize(
    ("value", "bad"),
    [("garbage", "'garbage'"), ("api-key=1,oops", "'oops'"), ("=x", "'=x'")],
)
def test_malformed_otel_headers_are_one_line(value: str, bad: str) -> None:
    (line,) = header_problems({"OTEL_EXPORTER_OTLP_TRACES_HEADERS": value})
    assert line.startswith("traceml: otlp: OTEL_EXPORTER_OTLP_TRACES_HEADERS is not")
    assert bad in line


def test_good_otel_headers_say_nothing() -> None:
    assert header_problems({"OTEL_EXPORTER_OTLP_HEADERS": "a=1, b=x%20y", "X": "garbage"}) == []


@pytest.mark.parametrize(
    ("value", "grpc", "problem"),
    [
        ("http://collector:4318", False, None),
        ("https://[::1]:4318/prefix", False, None),
        ("collector:4317", True, None),
        ("[::1]:4317", True, None),
        ("not-a-url", False, "is not a URL"),
        ("not-a-url", True, "is not a URL"),
        ("collector:4317", False, "is not a URL"),
        ("ftp://collector", False, "is not a URL"),
        (" http://collector:4318", False, "is not a URL"),
        ("http://", False, "has no host"),
        ("http://collector:http", False, "is not a URL"),
        ("http://collector:0", True, "has no valid port"),
    ],
)
def test_otlp_endpoints_must_be_urls(value: str, grpc: bool, problem: str | None) -> None:
    said = endpoint_problem(value, grpc=grpc)
    if problem is None:
        assert said is None
    else:
        assert said is not None and said.startswith(problem), said
        assert "http://HOST:PORT" in said and ("(or HOST:PORT)" in said) == grpc


def test_a_loss_of_the_live_views_only_says_the_files_are_complete(tmp_path: Path) -> None:
    warning = tmp_path / "finalization_warning.json"
    warning.write_text(json.dumps({"reason": "monitoring_incomplete"}))
    assert lost_what(warning) == "the live views lost data (the files are complete)"
    warning.write_text(json.dumps({"reason": "export_incomplete"}))
    assert lost_what(warning) == "something was lost"
    warning.write_text("not json")
    assert lost_what(warning) == "something was lost"
