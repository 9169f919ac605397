"""A real MLflow tracking server: ``mlflow server`` on sqlite, for the tests
(``tests/receivers/mlflow_server.py``), ``python -m bench.trackers`` and
``scripts/tracker_screenshots.py``.

:func:`mlflow_server` starts one on a free loopback port with its own database and
artifact folder, waits until ``/health`` answers and kills it (its whole process
group: the server runs uvicorn workers) at the end; :func:`start_mlflow_server`
starts one without waiting, so that its slow start can overlap other work. MLflow 3 ingests OTLP/HTTP traces
at ``/v1/traces``, into the experiment named by the ``x-mlflow-experiment-id``
header.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MlflowServer", "mlflow_server", "server_env", "start_mlflow_server"]

START_TIMEOUT_S = 90.0
"""Its first start creates the database and imports the server's app: slow."""

MLFLOW = str(Path(sys.executable).with_name("mlflow"))


class MlflowError(AssertionError):
    """The server did not start."""


class MlflowServer:
    """A running server."""

    def __init__(self, url: str, process: subprocess.Popen[bytes], log: Path) -> None:
        self.url = url
        """``http://127.0.0.1:PORT`` (the tracking URI)."""
        self.process = process
        self.log = log

    @property
    def traces_endpoint(self) -> str:
        return self.url + "/v1/traces"

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Wait until ``/health`` answers; fail after ``timeout_s`` or if it exits."""
        deadline = time.monotonic() + timeout_s
        while not _healthy(self.url):
            if self.process.poll() is not None:
                raise MlflowError(f"mlflow server exited:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise MlflowError(f"mlflow server not up after {timeout_s} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self) -> None:
        """Kill the server's process group (the CLI and its uvicorn worker)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1.0) as r:
            return int(r.status) == 200
    except (OSError, urllib.error.URLError):
        return False


def server_env() -> dict[str, str]:
    """The environment for the server and the client: no telemetry, no proxies."""
    env = dict(os.environ)
    env.update(
        {
            "MLFLOW_DISABLE_TELEMETRY": "true",
            # No job runner (huey consumers): the tests ingest traces and metrics only.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            "DO_NOT_TRACK": "true",
            "NO_PROXY": "127.0.0.1,localhost",
            "no_proxy": "127.0.0.1,localhost",
        }
    )
    return env


def start_mlflow_server(folder: Path) -> MlflowServer:
    """Start ``mlflow server`` with its store in ``folder``; returns at once (call
    :meth:`MlflowServer.wait_ready`, and :meth:`MlflowServer.stop` at the end)."""
    port = _free_port()
    log = folder / "mlflow.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                MLFLOW,
                "server",
                "--backend-store-uri",
                f"sqlite:///{folder / 'mlflow.db'}",
                "--default-artifact-root",
                str(folder / "artifacts"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
            ],
            cwd=folder,
            env=server_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    return MlflowServer(f"http://127.0.0.1:{port}", process, log)


@contextlib.contextmanager
def mlflow_server(
    folder: Path | None = None, *, start_timeout_s: float = START_TIMEOUT_S
) -> Iterator[MlflowServer]:
    """A running ``mlflow server`` with its store in ``folder`` (a temporary folder when
    not given), ready; killed on the way out."""
    with contextlib.ExitStack() as stack:
        if folder is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mlflow-")))
        server = start_mlflow_server(folder)
        try:
            server.wait_ready(start_timeout_s)
            yield server
        finally:
            server.stop()
