"""The aggregator under load: a real ``traceml serve`` subprocess, sampled."""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import psutil

from traceml_ai.transport.wire import ENV_RUN_TOKEN

from .items import LoadSpec

REPO = Path(__file__).resolve().parents[2]


# -- the aggregator process -------------------------------------------------------------


@dataclass
class Sample:
    t: float
    rss: int
    hwm: int
    fds: int
    threads: int
    cpu_s: float


@dataclass
class AggregatorProc:
    """A ``traceml serve`` subprocess and what was sampled of it."""

    popen: subprocess.Popen[bytes]
    run_dir: Path
    address: tuple[str, int]
    samples: list[Sample] = field(default_factory=list)
    exit_t: float | None = None
    rusage: Any = None
    stderr: bytes = b""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def sample_every(self, interval: float) -> None:
        proc = psutil.Process(self.pid)

        def loop() -> None:
            while not self._stop.is_set():
                s = _sample(proc)
                if s is None:
                    return
                self.samples.append(s)
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def sample_now(self) -> Sample | None:
        return _sample(psutil.Process(self.pid))

    def wait(self, timeout: float) -> bool:
        """Wait for exit (reaping it with wait4 for its exact CPU time and peak RSS)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid, status, usage = os.wait4(self.pid, os.WNOHANG)
            if pid:
                self.exit_t = time.monotonic()
                self.rusage = usage
                self.popen.returncode = os.waitstatus_to_exitcode(status)
                break
            time.sleep(0.05)
        else:
            return False
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        assert self.popen.stderr is not None
        self.stderr = self.popen.stderr.read()
        return True

    def kill(self) -> None:
        with _suppress():
            self.popen.send_signal(signal.SIGCONT)
            self.popen.kill()
        self.wait(10)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return True


def _sample(proc: psutil.Process) -> Sample | None:
    try:
        with proc.oneshot():
            cpu = proc.cpu_times()
            rss = proc.memory_info().rss
            threads = proc.num_threads()
            fds = proc.num_fds()
        hwm = 0
        with open(f"/proc/{proc.pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    hwm = int(line.split()[1]) * 1024
        return Sample(time.monotonic(), rss, hwm, fds, threads, cpu.user + cpu.system)
    except (psutil.Error, OSError):
        return None


@dataclass(frozen=True)
class QueueBounds:
    """Export queue bounds for the aggregator; ``traceml serve`` has no options for them,
    so a run with bounds uses this script's runner (same ``Aggregator`` and
    ``run_until_done`` as ``traceml serve``)."""

    batches: int | None = None
    bytes: int | None = None
    trace: Path | None = None  # queue depth, drops and GC CPU s into this file every 50 ms

    @property
    def custom(self) -> bool:
        return self.batches is not None or self.bytes is not None or self.trace is not None


# The aggregator as ``traceml serve`` runs it (same ``Aggregator`` and
# ``run_until_done``), with queue bounds and an optional queue-depth trace. Run with
# ``python -c`` so that the process imports nothing this script needs (numpy).
_SERVE_WITH_BOUNDS = """
import gc, os, sys, threading, time
from pathlib import Path
import orjson
from traceml_ai.aggregator import Aggregator, AggregatorConfig, run_until_done, tune_gc_for_aggregator
from traceml_ai.settings import ExportSettings
from traceml_ai.transport.wire import ENV_RUN_TOKEN

cfg = orjson.loads(sys.argv[1])
aggregator = Aggregator(AggregatorConfig(
    run_dir=Path(cfg["run_dir"]),
    settings=ExportSettings(exporter="jsonl", export_streams=cfg["streams"], exporter_hostname=False),
    token=os.environ[ENV_RUN_TOKEN],
    expected_world_size=cfg["ranks"],
    finalize_timeout_sec=60.0,
    max_queue_batches=cfg["batches"],
    max_queue_bytes=cfg["bytes"],
))
tune_gc_for_aggregator()  # as traceml serve does
host, port = aggregator.start()
print(f"export TRACEML_AGGREGATOR_ADDR={host}:{port}", flush=True)
if cfg["trace"]:
    worker = aggregator._pipeline.worker
    collecting = [0.0, 0.0]  # (when the running collection began, collections' CPU so far)
    def timed(phase, info):
        if phase == "start":
            collecting[0] = time.thread_time()
        else:
            collecting[1] += time.thread_time() - collecting[0]
    gc.callbacks.append(timed)
    def trace():
        t0 = time.monotonic()
        with open(cfg["trace"], "w") as out:
            while True:
                out.write(f"{time.monotonic() - t0:.3f} {worker.queued_batches} {worker.dropped_batches} {collecting[1]:.3f}\\n")
                out.flush()
                time.sleep(0.05)
    threading.Thread(target=trace, daemon=True).start()
run_until_done(aggregator, stop=threading.Event(), wait_for_ranks=True)
"""


def start_aggregator(
    logs_dir: Path,
    run_name: str,
    spec: LoadSpec,
    export_streams: str,
    token: str,
    bounds: QueueBounds | None = None,
) -> AggregatorProc:
    """``traceml serve`` on a free loopback port, expecting ``spec.ranks`` ranks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env[ENV_RUN_TOKEN] = token
    src = os.environ.get("SCALE_AGGREGATOR_SRC") or str(REPO / "src")  # e.g. a baseline's
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    cmd = [
        sys.executable,
        "-m",
        "traceml_ai",
        "serve",
        "--logs-dir",
        str(logs_dir),
        "--run-name",
        run_name,
        "--aggregator-bind-host",
        "127.0.0.1",
        "--aggregator-port",
        "0",
        "--nnodes",
        str(spec.nodes),
        "--nproc-per-node",
        str(spec.ranks_per_node),
        "--finalize-timeout-sec",
        "60",
        "--exporter",
        "jsonl",
        "--export-streams",
        export_streams,
    ]
    # Extra `traceml serve` flags, e.g. the live views (python -m bench.monitoring).
    cmd += shlex.split(os.environ.get("SCALE_AGGREGATOR_ARGS", ""))
    if bounds is not None and bounds.custom:
        cfg = {
            "run_dir": str(logs_dir / run_name),
            "streams": export_streams,
            "ranks": spec.ranks,
            "batches": bounds.batches,
            "bytes": bounds.bytes,
            "trace": str(bounds.trace) if bounds.trace else None,
        }
        cmd = [sys.executable, "-c", _SERVE_WITH_BOUNDS, orjson.dumps(cfg).decode()]
    popen = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=logs_dir
    )
    assert popen.stdout is not None
    line = popen.stdout.readline().decode()
    if "TRACEML_AGGREGATOR_ADDR=" not in line:
        popen.kill()
        err = popen.stderr.read().decode() if popen.stderr else ""
        raise RuntimeError(f"traceml serve did not start: {line!r} {err}")
    addr = line.split("TRACEML_AGGREGATOR_ADDR=")[1].split()[0]
    host, port = addr.rsplit(":", 1)
    return AggregatorProc(popen, logs_dir / run_name, (host, int(port)))
