"""``traceml serve --relay`` given wrong addresses, as a newcomer might: each gets one
clear line and an exit code, never a traceback nor a relay that spins on itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e_helpers import free_port, run_cli

TIMEOUT_S = 60.0


@pytest.mark.parametrize(
    ("address", "said"),
    [
        ("10.0.0.1", "expected HOST:PORT"),
        ("10.0.0.1:notaport", "expected a port from 1 to 65535, got 'notaport'"),
        ("127.0.0.1:99999", "expected a port from 1 to 65535"),
        (":29600", "expected a host name or an IP address"),
    ],
)
def test_a_malformed_relay_address_is_one_line(tmp_path: Path, address: str, said: str) -> None:
    done = run_cli(
        ["serve", "--relay", address, "--aggregator-port", str(free_port())],
        cwd=tmp_path,
        env={"TRACEML_RUN_TOKEN": "t"},
        timeout=TIMEOUT_S,
    )
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert said in lines[0] and "--relay" in lines[0]


@pytest.mark.parametrize("upstream_host", ["127.0.0.1", "localhost"])
def test_a_relay_given_its_own_port_says_so_and_exits(tmp_path: Path, upstream_host: str) -> None:
    port = free_port()
    done = run_cli(
        ["serve", "--relay", f"{upstream_host}:{port}", "--aggregator-port", str(port)],
        cwd=tmp_path,
        env={"TRACEML_RUN_TOKEN": "t"},
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.count("leads back to this relay") == 1, done.stderr
    assert "relay stopped" in done.stderr
