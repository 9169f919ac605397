"""Helpers for the end-to-end CLI tests: real ``traceml`` processes, real files.

Every process gets an explicit environment without any inherited ``TRACEML_*``
variable, runs in the test's own folder (so no ``traceml.yaml`` leaks in) and has a
timeout. Nothing here asserts on timing.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson

from traceml_records import STREAMS

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train.py"
PY = sys.executable

RUN_TIMEOUT_S = 240.0
"""Upper bound for one ``traceml`` process; generous because the machine is shared."""

ALL_FILES = tuple(spec.name for spec in STREAMS)
"""Every export stream (``--export-streams all``), from the registry."""
INTERNAL_PHASES = (
    "_traceml_internal:backward_time",
    "_traceml_internal:dataloader_next",
    "_traceml_internal:forward_time",
    "_traceml_internal:optimizer_step",
    "_traceml_internal:step_time",
)


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The inherited environment without ``TRACEML_*``, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    # Ranks of two runs on two busy cores: one thread each keeps them from starving.
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    # `traceml` must import from this checkout whatever the test's cwd.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO / "src"), str(REPO), env.get("PYTHONPATH", "")) if p
    )
    if extra:
        env.update(extra)
    return env


def traceml_cmd(*args: str | Path) -> list[str]:
    """``python -m traceml_ai ARGS`` (the ``traceml`` command) with this interpreter."""
    return [PY, "-m", "traceml_ai", *(str(a) for a in args)]


def _ephemeral_ports_start() -> int:
    """Where the kernel's range of ports for outgoing connections starts."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port free right now on the loopback, for something a test binds later (a
    rendezvous, an aggregator that starts after its ranks or relay), or where nothing
    listens. Below the kernel's range for outgoing connections when it can be: a port
    probed free there can be taken before the test binds it, as the source port of any
    connection on the machine, or of one made to that very port while nothing listens
    (a socket then connects to itself)."""
    below = _ephemeral_ports_start()
    if below > 2048:
        for _ in range(100):
            port = random.randrange(below // 2, below)
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_cli(
    args: Sequence[str | Path],
    *,
    cwd: Path,
    env: Mapping[str, str] | None = None,
    timeout: float = RUN_TIMEOUT_S,
) -> subprocess.CompletedProcess[str]:
    """Run ``traceml ARGS`` to completion and capture its output."""
    return subprocess.run(
        traceml_cmd(*args),
        cwd=cwd,
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def start_cli(
    args: Sequence[str | Path],
    *,
    cwd: Path,
    command: Sequence[str] | None = None,
    new_session: bool = False,
) -> subprocess.Popen[str]:
    """Start ``traceml ARGS`` (or ``COMMAND ARGS``) in the background, output piped."""
    return subprocess.Popen(
        [*(command or traceml_cmd()), *(str(a) for a in args)],
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=new_session,
    )


def train_run_args(
    logs: Path,
    run_name: str,
    *options: str | Path,
    steps: int = 4,
    script_args: Sequence[str] = (),
) -> list[str | Path]:
    """``run --logs-dir LOGS --run-name NAME --interval 0.2 OPTIONS train.py --steps N``."""
    return [
        "run",
        "--logs-dir",
        logs,
        "--run-name",
        run_name,
        "--interval",
        "0.2",
        *options,
        TRAIN,
        "--steps",
        str(steps),
        *script_args,
    ]


def read_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a JSONL file as an object (each line must end in a newline)."""
    data = path.read_bytes()
    assert data.endswith(b"\n"), f"{path}: last line unterminated"
    out = []
    for line in data.splitlines():
        obj = orjson.loads(line)
        assert isinstance(obj, dict), f"{path}: {line!r}"
        out.append(obj)
    return out


def data_lines(path: Path) -> list[dict[str, Any]]:
    """The data lines of a cleanly closed export file, after checking its closing line.

    The closing line must be the last line and the only one, name the file's stream,
    count the data lines, and carry no hostname.
    """
    lines = read_lines(path)
    assert lines, f"{path} is empty"
    closing = lines[-1]
    stream = path.name.removesuffix(".jsonl")
    assert list(closing) == [
        "stream",
        "closing",
        "schema_version",
        "written_records",
        "dropped_batches",
    ], closing
    assert closing["closing"] is True
    assert closing["stream"] == stream
    assert closing["schema_version"] == 1
    data = lines[:-1]
    assert closing["written_records"] == len(data), (path, closing, len(data))
    for d in data:
        assert "closing" not in d, f"{path}: two closing lines"
        assert d["stream"] == stream
        assert d["schema_version"] == 1
    return data


def closing_line(path: Path) -> dict[str, Any]:
    """The last line of an export file, which must be its closing line."""
    last = read_lines(path)[-1]
    assert last.get("closing") is True, f"{path}: no closing line"
    return last


def export_dir(logs: Path, run_name: str) -> Path:
    return logs / run_name / "aggregator" / "export"


def export_files(logs: Path, run_name: str) -> set[str]:
    """Names of the files in the run's export folder (empty when there is none)."""
    folder = export_dir(logs, run_name)
    return {p.name for p in folder.iterdir()} if folder.is_dir() else set()


def assert_valid(path: Path, cwd: Path) -> None:
    """``traceml validate PATH`` exits 0."""
    res = run_cli(["validate", path], cwd=cwd, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def warning_file(logs: Path, run_name: str) -> dict[str, Any] | None:
    path = logs / run_name / "finalization_warning.json"
    if not path.exists():
        return None
    obj = orjson.loads(path.read_bytes())
    assert isinstance(obj, dict)
    return obj


def wait_for(
    predicate: Callable[[], bool], *, timeout: float, what: str, poll: float = 0.1
) -> None:
    """Poll ``predicate`` until it holds; fail the test naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(poll)


def has_data_line(path: Path) -> bool:
    """Whether a (growing) export file has at least one complete data line."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return False
    return any(line and b'"closing"' not in line for line in data.split(b"\n")[:-1])
