"""Aggregator at scale: N simulated ranks over the real transport and wire format.

Prints figures and checks the files; never passes or fails on time. The aggregator is
a real ``traceml serve`` subprocess (``--exporter jsonl --export-streams <streams>
--aggregator-port 0 --nnodes N/8 --nproc-per-node 8``); the ranks are simulated by a
few generator processes, each holding one TCP connection per rank and sending what a
``RankSender`` would: every ``1/--flush-hz`` s per rank, one ``step_time`` and one
``step_memory`` batch with the steps done since the last flush, a ``process`` item
every ``--sampler-interval`` s, a ``system`` snapshot with ``--gpus`` GPUs from local
rank 0 of each node, one ``runtime_environment`` item at the start and ``finished``
at the end. Frames are encoded with the real ``make_batch_message``/``encode_frame``.

Modes (one per run):

    .venv/bin/python bench/scale.py --ranks 1024 --steps-per-s 10 --seconds 60
    .venv/bin/python bench/scale.py --ranks 1024 --find-max            # highest rate, 0 drops
    .venv/bin/python bench/scale.py --ranks 1024 --steps-per-s 250 --seconds 30 --overload
    .venv/bin/python bench/scale.py --ranks 1024 --steps-per-s 10 --soak     # 10 minutes
    .venv/bin/python bench/scale.py --pause --ranks 8 --steps-per-s 100 --seconds 20

Accounting (exact, also with drops): every item of a (rank, wire stream) has its own
``seq`` (0, 1, 2, ...), and the generator logs each batch as (first seq, item count,
sent or dropped by the generator). After the run every record of the files is counted
by key. Every key must appear at most once; every batch the generator sent must be in
the files whole or not at all; the number of missing batches must equal the
aggregator's ``dropped_batches`` (closing lines, ``aggregator/stats.json``) less the
generator-dropped batches of selected streams, which the generator reports in its
``finished`` message and the aggregator counts too; so
records written + records in aggregator-dropped batches + records in generator-dropped
batches = records generated, batch by batch. Generator sockets are non-blocking: a
connection with more than ``--sender-buffer-kib`` unsent drops the batch (counted), so a
sender never blocks.

Last line: ``ranks=<n> steps_per_s=<s> records_per_s=<r> dropped_batches=<d>
peak_rss_mb=<m> max_sustained_records_per_s=<x>``.
"""

from __future__ import annotations

import argparse
import array
import heapq
import math
import multiprocessing as mp
import os
import pickle
import re
import resource
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import psutil

from traceml_ai.export._builder import batch_streams_for
from traceml_ai.wire import ENV_RUN_TOKEN, encode_frame, make_batch_message, make_finished_message
from traceml_records import parse_export_streams

REPO = Path(__file__).resolve().parents[1]
WIRE_ORDER = ("runtime_environment", "step_time", "step_memory", "process", "system")


# -- what a rank sends ------------------------------------------------------------------


def _gpu_timing(ms: float) -> dict[str, Any]:
    return {"cpu_ms": ms * 0.2, "duration_ms": ms, "gpu_ms": ms, "is_gpu": True, "n_calls": 1}


def _cpu_timing(ms: float) -> dict[str, Any]:
    return {"cpu_ms": ms, "duration_ms": ms, "gpu_ms": None, "is_gpu": False, "n_calls": 1}


def step_events(device: str) -> dict[str, Any]:
    """The phases of one GPU step as the rank SDK reports them."""
    return {
        "_traceml_internal:dataloader_next": {"cpu": _cpu_timing(3.7009716033935547)},
        "_traceml_internal:forward_time": {device: _gpu_timing(8.20612907409668)},
        "_traceml_internal:backward_time": {device: _gpu_timing(15.316009521484375)},
        "_traceml_internal:optimizer_step": {device: _gpu_timing(0.5419254302978516)},
        "_traceml_internal:step_time": {device: _gpu_timing(27.03070640563965)},
    }


def process_item(seq: int, ts: int, local_rank: int) -> dict[str, Any]:
    return {
        "timestamp_unix_ns": ts,
        "seq": seq,
        "cpu_percent": 101.5,
        "cpu_logical_cores": 16,
        "ram_used_bytes": 3_123_456_789,
        "ram_total_bytes": 64 * 2**30,
        "gpu_available": True,
        "gpu_count": 8,
        "gpu_device_index": local_rank % 8,
        "gpu_memory_used_bytes": 30 * 10**9,
        "gpu_memory_reserved_bytes": 32 * 10**9,
        "gpu_memory_total_bytes": 80 * 10**9,
        "gpu_uuid": None,
    }


def system_item(seq: int, ts: int, gpus: int) -> dict[str, Any]:
    return {
        "timestamp_unix_ns": ts,
        "seq": seq,
        "cpu_percent": 42.5,
        "ram_used_bytes": 10 * 2**30,
        "ram_total_bytes": 64 * 2**30,
        "gpu_available": gpus > 0,
        "gpus": [
            {
                "gpu_index": i,
                "utilization_percent": 87.0,
                "memory_used_bytes": 30 * 10**9,
                "memory_total_bytes": 80 * 10**9,
                "temperature_c": 61.0,
                "power_usage_w": 250.5,
                "power_limit_w": 700.0,
                "gpu_uuid": None,
            }
            for i in range(gpus)
        ],
    }


def runtime_item(ts: int, world_size: int, local_world_size: int) -> dict[str, Any]:
    if world_size == 1:
        topology = "single_process"
    elif local_world_size == world_size:
        topology = "single_node_multi_process"
    else:
        topology = "multi_node"
    return {
        "timestamp_unix_ns": ts,
        "seq": 0,
        "topology": topology,
        "distributed_initialized": True,
        "distributed_backend": "nccl",
        "training_strategy": "ddp",
        "strategy_source": "runtime_model",
        "strategy_confidence": "high",
        "torch_version": "2.13.0",
        "python_version": "3.11.7",
    }


@dataclass(frozen=True)
class LoadSpec:
    """What the simulated job sends."""

    ranks: int
    steps_per_s: float
    seconds: float
    ranks_per_node: int = 8
    gpus: int = 8
    flush_hz: float = 4.0
    sampler_interval_s: float = 2.0
    wire_streams: tuple[str, ...] = WIRE_ORDER
    sender_buffer_bytes: int = 4 * 2**20

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    @property
    def total_steps(self) -> int:
        return round(self.steps_per_s * self.seconds)

    @property
    def total_samples(self) -> int:
        return max(1, math.ceil(self.seconds / self.sampler_interval_s))

    def identity(self, rank: int) -> dict[str, Any]:
        return {
            "global_rank": rank,
            "local_rank": rank % self.ranks_per_node,
            "world_size": self.ranks,
            "local_world_size": self.ranks_per_node,
            "node_rank": rank // self.ranks_per_node,
            "hostname": f"node-{rank // self.ranks_per_node:04d}",
            "pid": 100_000 + rank,
        }


# -- generator processes ----------------------------------------------------------------


class _Log:
    """The batches of one (rank, wire stream): first seq, item count, 1 if dropped here."""

    __slots__ = ("dropped", "sizes", "starts")

    def __init__(self) -> None:
        self.starts = array.array("q")
        self.sizes = array.array("i")
        self.dropped = array.array("b")


class _Rank:
    __slots__ = (
        "device",
        "dropped_batches",
        "dropped_by_stream",
        "events",
        "identity",
        "local_rank",
        "logs",
        "next_env",
        "next_proc",
        "next_step",
        "next_sys",
        "pending",
        "rank",
        "sent_batches",
        "sock",
    )

    def __init__(self, spec: LoadSpec, rank: int, sock: socket.socket) -> None:
        self.rank = rank
        self.identity = spec.identity(rank)
        self.local_rank = rank % spec.ranks_per_node
        self.device = f"cuda:{self.local_rank}"
        self.events = step_events(self.device)
        self.sock = sock
        self.pending = bytearray()
        self.next_step = 0
        self.next_proc = 0
        self.next_sys = 0
        self.next_env = 0
        self.sent_batches = 0
        self.dropped_batches = 0
        self.dropped_by_stream: dict[str, int] = {}
        self.logs = {stream: _Log() for stream in spec.wire_streams}


class _Generator:
    """Simulates ranks ``[first, last)`` on one connection each, from one process."""

    def __init__(self, spec: LoadSpec, token: str, address: tuple[str, int], ranks: range):
        self.spec = spec
        self.token = token
        self.ranks: list[_Rank] = []
        for rank in ranks:
            sock = socket.create_connection(address, timeout=30)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setblocking(False)
            self.ranks.append(_Rank(spec, rank, sock))
        self.selector = selectors.DefaultSelector()
        self.waiting: set[int] = set()
        self.max_lag_s = 0.0
        self.max_flush_s = 0.0
        self.max_pending = 0
        self.items = 0

    def run(self, t0: float) -> None:
        spec = self.spec
        period = 1.0 / spec.flush_hz
        end = t0 + spec.seconds
        n = len(self.ranks)
        # Flushes are spread evenly over the period, as independent ranks would be.
        heap = [(t0 + period * ((i * 0.618033988749895) % 1.0), i) for i in range(n)]
        heapq.heapify(heap)
        clock = time.monotonic
        while heap:
            due, i = heap[0]
            now = clock()
            if due > now:
                self._wait(min(due - now, 0.02))
                continue
            heapq.heappop(heap)
            self.max_lag_s = max(self.max_lag_s, now - due)
            final = due >= end
            begin = time.perf_counter()
            self._flush(self.ranks[i], min(now, end) - t0, final)
            self.max_flush_s = max(self.max_flush_s, time.perf_counter() - begin)
            if not final:
                heapq.heappush(heap, (min(due + period, end), i))
        self._drain()

    def _flush(self, r: _Rank, elapsed: float, final: bool) -> None:
        spec = self.spec
        ts = time.time_ns()
        streams = spec.wire_streams
        if "runtime_environment" in streams and r.next_env == 0:
            item = runtime_item(ts, spec.ranks, spec.ranks_per_node)
            self._batch(r, "runtime_environment", 0, [item])
            r.next_env = 1
        steps = (
            spec.total_steps if final else min(spec.total_steps, int(elapsed * spec.steps_per_s))
        )
        a = r.next_step
        if steps > a:
            r.next_step = steps
            if "step_time" in streams:
                ev = r.events
                items = [
                    {"timestamp_unix_ns": ts, "seq": k, "step": k + 1, "events": ev}
                    for k in range(a, steps)
                ]
                self._batch(r, "step_time", a, items)
            if "step_memory" in streams:
                dev = r.device
                items = [
                    {
                        "timestamp_unix_ns": ts,
                        "seq": k,
                        "step": k + 1,
                        "device": dev,
                        "peak_allocated_bytes": 20_000_000_000 + k,
                        "peak_reserved_bytes": 24_000_000_000,
                    }
                    for k in range(a, steps)
                ]
                self._batch(r, "step_memory", a, items)
        samples = (
            spec.total_samples
            if final
            else min(spec.total_samples, int(elapsed / spec.sampler_interval_s) + 1)
        )
        if "process" in streams and samples > r.next_proc:
            a, r.next_proc = r.next_proc, samples
            items = [process_item(k, ts, r.local_rank) for k in range(a, samples)]
            self._batch(r, "process", a, items)
        if "system" in streams and r.local_rank == 0 and samples > r.next_sys:
            a, r.next_sys = r.next_sys, samples
            items = [system_item(k, ts, spec.gpus) for k in range(a, samples)]
            self._batch(r, "system", a, items)
        self._send(r)

    def _batch(self, r: _Rank, stream: str, first: int, items: list[dict[str, Any]]) -> None:
        frame = encode_frame(make_batch_message(self.token, r.identity, stream, items))
        log = r.logs[stream]
        log.starts.append(first)
        log.sizes.append(len(items))
        self.items += len(items)
        if len(r.pending) + len(frame) > self.spec.sender_buffer_bytes:
            log.dropped.append(1)
            r.dropped_batches += 1
            r.dropped_by_stream[stream] = r.dropped_by_stream.get(stream, 0) + 1
            return
        log.dropped.append(0)
        r.sent_batches += 1
        r.pending += frame

    def _send(self, r: _Rank) -> None:
        if not r.pending:
            return
        try:
            n = r.sock.send(r.pending)
        except BlockingIOError:
            n = 0
        if n:
            del r.pending[:n]
        self.max_pending = max(self.max_pending, len(r.pending))
        if r.pending and r.rank not in self.waiting:
            self.waiting.add(r.rank)
            self.selector.register(r.sock, selectors.EVENT_WRITE, r)
        elif not r.pending and r.rank in self.waiting:
            self.waiting.discard(r.rank)
            self.selector.unregister(r.sock)

    def _wait(self, timeout: float) -> None:
        if not self.waiting:
            time.sleep(timeout)
            return
        for key, _ in self.selector.select(timeout):
            self._send(key.data)

    def _drain(self) -> None:
        """After the load: send what is left (blocking, bounded), then ``finished``."""
        for r in self.ranks:
            if r.rank in self.waiting:
                self.selector.unregister(r.sock)
            r.sock.setblocking(True)
            r.sock.settimeout(120)
            finished = make_finished_message(
                self.token, r.identity, r.sent_batches, r.dropped_batches, r.dropped_by_stream
            )
            r.sock.sendall(bytes(r.pending) + encode_frame(finished))
            r.pending.clear()
        self.waiting.clear()
        for r in self.ranks:
            r.sock.close()

    def result(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "logs": {
                r.rank: {
                    s: (log.starts.tobytes(), log.sizes.tobytes(), log.dropped.tobytes())
                    for s, log in r.logs.items()
                }
                for r in self.ranks
            },
            "cpu_s": usage.ru_utime + usage.ru_stime,
            "max_lag_s": self.max_lag_s,
            "max_flush_s": self.max_flush_s,
            "max_pending_bytes": self.max_pending,
            "items": self.items,
            "sender_dropped_batches": sum(r.dropped_batches for r in self.ranks),
        }


def _generator_main(
    spec: LoadSpec,
    token: str,
    address: tuple[str, int],
    first: int,
    last: int,
    conn: Connection,
    out_path: str,
) -> None:
    try:
        gen = _Generator(spec, token, address, range(first, last))
        conn.send("connected")
        t0 = conn.recv()
        gen.run(t0)
        Path(out_path).write_bytes(pickle.dumps(gen.result()))
        conn.send("done")
    except BaseException as exc:
        conn.send(f"error: {exc!r}")
        raise


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
    trace: Path | None = None  # sample the queue depth into this file every 50 ms

    @property
    def custom(self) -> bool:
        return self.batches is not None or self.bytes is not None or self.trace is not None


# The aggregator as ``traceml serve`` runs it (same ``Aggregator`` and
# ``run_until_done``), with queue bounds and an optional queue-depth trace. Run with
# ``python -c`` so that the process imports nothing this script needs (numpy).
_SERVE_WITH_BOUNDS = """
import os, sys, threading, time
from pathlib import Path
import orjson
from traceml_ai.aggregator import Aggregator, AggregatorConfig, run_until_done
from traceml_ai.settings import ExportSettings
from traceml_ai.wire import ENV_RUN_TOKEN

cfg = orjson.loads(sys.argv[1])
aggregator = Aggregator(AggregatorConfig(
    run_dir=Path(cfg["run_dir"]),
    settings=ExportSettings(exporter="jsonl", export_streams=cfg["streams"], exporter_hostname=False),
    token=os.environ[ENV_RUN_TOKEN],
    expected_world_size=cfg["ranks"],
    finalize_timeout_s=60.0,
    max_queue_batches=cfg["batches"],
    max_queue_bytes=cfg["bytes"],
))
host, port = aggregator.start()
print(f"export TRACEML_AGGREGATOR_ADDR={host}:{port}", flush=True)
if cfg["trace"]:
    worker = aggregator._pipeline.worker
    def trace():
        t0 = time.monotonic()
        with open(cfg["trace"], "w") as out:
            while True:
                out.write(f"{time.monotonic() - t0:.3f} {worker.queued_batches} {worker.dropped_batches}\\n")
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


# -- checking the files -----------------------------------------------------------------


@dataclass
class Check:
    """What the files say, against what the generator logged."""

    generated_records: int = 0
    written_records: int = 0
    sender_dropped_batches: int = 0
    sender_dropped_records: int = 0
    sender_dropped_selected_batches: int = 0
    """Generator-dropped batches of wire streams that feed a selected file: the aggregator
    counts them in its ``dropped_batches`` too (the generator reports them in ``finished``)."""
    missing_batches: int = 0
    missing_records: int = 0
    partial_batches: int = 0
    duplicates: int = 0
    unexpected: int = 0
    agg_dropped_batches: int = -1
    closing_ok: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return (
            not self.problems
            and self.partial_batches == 0
            and self.duplicates == 0
            and self.unexpected == 0
            and self.closing_ok
            and self.missing_batches
            == self.agg_dropped_batches - self.sender_dropped_selected_batches
            and self.written_records + self.missing_records + self.sender_dropped_records
            == self.generated_records
        )


def _records_per_item(wire: str, files: set[str], gpus: int) -> int:
    if wire == "system":
        return ("system" in files) + gpus * ("system_gpu" in files)
    return 1 if wire in files else 0


def _read_keys(path: Path, fields: Sequence[str]) -> tuple[list[list[int]], dict[str, Any] | None]:
    """Columns of ``fields`` over the data lines of ``path``, and its closing line."""
    cols: list[list[int]] = [[] for _ in fields]
    appends = [c.append for c in cols]
    closing = None
    loads = orjson.loads
    with open(path, "rb") as f:
        for line in f:
            obj = loads(line)
            if obj.get("closing") is True:
                closing = obj
                continue
            for append, name in zip(appends, fields, strict=True):
                append(obj[name])
    return cols, closing


def check_files(
    run_dir: Path, spec: LoadSpec, files: tuple[str, ...], logs: dict[int, dict[str, Any]]
) -> Check:
    """Count every record of the files by key against the generator's batch logs."""
    out = Check()
    export = run_dir / "aggregator" / "export"
    fileset = set(files)
    n, g = spec.ranks, spec.gpus
    # Count arrays per wire stream, indexed [rank, seq] (system_gpu adds a gpu axis).
    max_seq = {s: 1 for s in spec.wire_streams}
    for per_rank in logs.values():
        for s, (starts, sizes, _) in per_rank.items():
            if starts:
                st = np.frombuffer(starts, dtype=np.int64)
                sz = np.frombuffer(sizes, dtype=np.int32)
                max_seq[s] = max(max_seq[s], int(st[-1] + sz[-1]))
    counts: dict[str, np.ndarray] = {}
    closings: dict[str, dict[str, Any] | None] = {}
    plan = {
        "step_time": ("step_time", ("global_rank", "seq", "step")),
        "step_memory": ("step_memory", ("global_rank", "seq", "step")),
        "process": ("process", ("global_rank", "seq")),
        "system": ("system", ("node_rank", "seq")),
        "system_gpu": ("system", ("node_rank", "seq", "gpu_index")),
        "runtime_environment": ("runtime_environment", ("global_rank", "seq")),
        "stdout_stderr": ("stdout_stderr", ("rank", "seq")),
    }
    for stream in files:
        wire, fields = plan[stream]
        path = export / f"{stream}.jsonl"
        if not path.exists():
            out.problems.append(f"{stream}.jsonl missing")
            continue
        cols, closings[stream] = _read_keys(path, fields)
        out.written_records += len(cols[0])
        if wire not in spec.wire_streams:
            out.unexpected += len(cols[0])
            continue
        a = np.asarray(cols[0], dtype=np.int64)
        seq = np.asarray(cols[1], dtype=np.int64)
        if stream in ("system", "system_gpu"):
            a = a * spec.ranks_per_node  # node_rank -> its local rank 0
        steps_ok = stream not in ("step_time", "step_memory") or np.array_equal(
            np.asarray(cols[-1], dtype=np.int64), seq + 1
        )
        if not steps_ok:
            out.problems.append(f"{stream}: step != seq + 1")
        width = max_seq[wire]
        ok = (a >= 0) & (a < n) & (seq >= 0) & (seq < width)
        if stream == "system_gpu":
            gi = np.asarray(cols[2], dtype=np.int64)
            ok &= (gi >= 0) & (gi < g)
            c = np.zeros((n, width, g), dtype=np.int32)
            np.add.at(c, (a[ok], seq[ok], gi[ok]), 1)
        else:
            c = np.zeros((n, width), dtype=np.int32)
            np.add.at(c, (a[ok], seq[ok]), 1)
        out.unexpected += int((~ok).sum())
        out.duplicates += int((c > 1).sum())
        counts[stream] = c

    # Records each wire item became, per item: system items feed two files.
    per_item: dict[str, np.ndarray] = {}
    for wire in spec.wire_streams:
        shape = (n, max_seq[wire])
        total = np.zeros(shape, dtype=np.int32)
        for stream, (w, _) in plan.items():
            if w == wire and stream in counts:
                c = counts[stream]
                total += c.sum(axis=2) if c.ndim == 3 else c
        per_item[wire] = total
    for rank, per_rank in logs.items():
        for wire, (starts_b, sizes_b, dropped_b) in per_rank.items():
            if not starts_b:
                continue
            starts = np.frombuffer(starts_b, dtype=np.int64)
            sizes = np.frombuffer(sizes_b, dtype=np.int32).astype(np.int64)
            dropped = np.frombuffer(dropped_b, dtype=np.int8).astype(bool)
            r = _records_per_item(wire, fileset, g)
            row = per_item[wire][rank]
            got = np.add.reduceat(row[: int(starts[-1] + sizes[-1])], starts)
            want = sizes * r
            out.generated_records += int(want.sum())
            out.sender_dropped_batches += int(dropped.sum())
            out.sender_dropped_records += int(want[dropped].sum())
            if r == 0:
                continue
            out.sender_dropped_selected_batches += int(dropped.sum())
            if int(got[dropped].sum()):
                out.problems.append(
                    f"rank {rank} {wire}: a batch dropped by the sender was written"
                )
            sent = ~dropped
            whole = got[sent] == want[sent]
            none = got[sent] == 0
            out.partial_batches += int((~whole & ~none).sum())
            out.missing_batches += int(none.sum())
            out.missing_records += int(want[sent][none].sum())
    dropped_seen = {c.get("dropped_batches") for c in closings.values() if c}
    written_ok = all(
        c is not None and c.get("written_records") == int(counts[s].sum())
        for s, c in closings.items()
        if s in counts
    )
    out.closing_ok = len(dropped_seen) == 1 and written_ok and len(closings) == len(files)
    if dropped_seen:
        out.agg_dropped_batches = int(min(x for x in dropped_seen if x is not None))
    return out


def validate(run_dir: Path) -> tuple[bool, float, str]:
    """``traceml validate`` on the run folder: (ok, seconds, last output line)."""
    begin = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-m", "traceml_ai", "validate", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=3600,
        cwd=run_dir,
    )
    lines = (res.stdout + res.stderr).strip().splitlines()
    ok_files = sum(1 for line in lines if line.endswith(", OK"))
    summary = (
        f"{ok_files} of {len(lines)} files OK" if res.returncode == 0 else "\n".join(lines[-5:])
    )
    return res.returncode == 0, time.monotonic() - begin, summary


def py_spy(out: Path, seconds: float) -> Callable[[AggregatorProc, float], None]:
    """A ``during`` hook: sample the aggregator with py-spy for the load's duration."""

    def start(agg: AggregatorProc, t0: float) -> None:
        exe = Path(sys.executable).with_name("py-spy")
        cmd = [str(exe), "record", "--pid", str(agg.pid), "--format", "raw", "--rate", "200"]
        cmd += [
            "--gil",
            "--nonblocking",
            "--duration",
            str(max(1, int(seconds))),
            "--output",
            str(out),
        ]
        threading.Thread(
            target=subprocess.run,
            args=(cmd,),
            kwargs={"capture_output": True, "timeout": seconds + 120},
            daemon=True,
        ).start()

    return start


def summarize_profile(path: Path, top: int = 15) -> None:
    """Top functions of a py-spy ``raw`` (collapsed stacks) profile: self and total %."""
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)  # py-spy writes the file when the target exits
    print_profile(path, top)


def print_profile(path: Path, top: int = 15) -> None:
    """Print the summary of a py-spy ``raw`` profile (also ``scale.py --summarize FILE``)."""
    selfs: dict[str, int] = {}
    totals: dict[str, int] = {}
    threads: dict[str, int] = {}
    n = 0
    for line in path.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_s)
        # One entry per function: "name (file:line)" -> "name (file)".
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        n += count
        threads[frames[0]] = threads.get(frames[0], 0) + count
        leaf = frames[-1]
        selfs[leaf] = selfs.get(leaf, 0) + count
        for f in set(frames[1:]):
            totals[f] = totals.get(f, 0) + count
    if not n:
        print("profile: no samples")
        return
    print(f"profile: {n:,} samples ({path})")
    for name, count in sorted(threads.items(), key=lambda kv: -kv[1])[:4]:
        print(f"  thread {count / n * 100:5.1f}%  {name}")
    print("  top self:")
    for name, count in sorted(selfs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {count / n * 100:5.1f}%  {name}")
    print("  top total:")
    for name, count in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {count / n * 100:5.1f}%  {name}")


# -- one run ------------------------------------------------------------------------------


@dataclass
class RunResult:
    spec: LoadSpec
    generated_records: int
    written_records: int
    records_per_s: float
    offered_records_per_s: float
    agg_dropped_batches: int
    sender_dropped_batches: int
    cpu_s_per_1k: float
    agg_cpu_cores: float
    gen_cpu_cores: float
    peak_rss_mb: float
    idle_rss_mb: float
    queue_hw_batches: int
    queue_hw_bytes: int
    max_queue_bytes: int
    drain_s: float
    gen_max_lag_s: float
    gen_max_flush_ms: float
    gen_max_pending_kib: float
    check: Check
    stats: dict[str, Any]
    samples: list[Sample]
    t0: float
    valid: tuple[bool, float, str] | None

    @property
    def dropped(self) -> int:
        return self.agg_dropped_batches + self.sender_dropped_batches

    @property
    def sustained(self) -> bool:
        """No batch lost anywhere, exact accounting, the generator kept its schedule, and
        the queue never got past half its byte bound (a queue that fills up slowly over a
        probe would drop in a longer run)."""
        headroom = self.max_queue_bytes <= 0 or self.queue_hw_bytes <= self.max_queue_bytes / 2
        return self.dropped == 0 and self.check.exact and self.gen_max_lag_s < 0.5 and headroom


def run_once(
    spec: LoadSpec,
    export_streams: str,
    *,
    logs_dir: Path,
    run_name: str,
    procs: int,
    do_validate: bool,
    sample_interval_s: float = 0.25,
    during: Callable[[AggregatorProc, float], None] | None = None,
    quiet: bool = False,
    bounds: QueueBounds | None = None,
) -> RunResult:
    files = parse_export_streams(export_streams)
    token = f"scale-{os.getpid()}-{time.monotonic_ns()}"
    agg = start_aggregator(logs_dir, run_name, spec, export_streams, token, bounds)
    ctx = mp.get_context("fork")
    workdir = Path(tempfile.mkdtemp(prefix="scale-gen-"))
    gens: list[tuple[Any, Connection, Path]] = []
    try:
        edges = np.linspace(0, spec.ranks, procs + 1).astype(int)
        for p in range(procs):
            parent, child = ctx.Pipe()
            out_path = workdir / f"gen{p}.pkl"
            proc = ctx.Process(
                target=_generator_main,
                args=(
                    spec,
                    token,
                    agg.address,
                    int(edges[p]),
                    int(edges[p + 1]),
                    child,
                    str(out_path),
                ),
                daemon=True,
            )
            proc.start()
            gens.append((proc, parent, out_path))
        for _, conn, _ in gens:
            msg = conn.recv()
            if msg != "connected":
                raise RuntimeError(f"generator failed: {msg}")
        time.sleep(0.5)
        idle = agg.sample_now()
        assert idle is not None
        agg.sample_every(sample_interval_s)
        t0 = time.monotonic() + 0.2
        for _, conn, _ in gens:
            conn.send(t0)
        if during is not None:
            during(agg, t0)
        results = []
        for proc, conn, out_path in gens:
            if not conn.poll(spec.seconds + 600):
                raise RuntimeError("generator did not finish")
            msg = conn.recv()
            if msg != "done":
                raise RuntimeError(f"generator failed: {msg}")
            proc.join(30)
            results.append(pickle.loads(out_path.read_bytes()))
        gen_done = time.monotonic()
        if not agg.wait(180):
            agg.popen.send_signal(signal.SIGTERM)
            agg.wait(90)
            raise RuntimeError("aggregator did not finalize on its own")
    except BaseException:
        for proc, _, _ in gens:
            if proc.is_alive():
                proc.kill()
        if agg.exit_t is None:
            agg.kill()
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    logs: dict[int, dict[str, Any]] = {}
    for res in results:
        logs.update(res["logs"])
    stats_path = agg.run_dir / "aggregator" / "stats.json"
    stats = orjson.loads(stats_path.read_bytes()) if stats_path.exists() else {}
    check = check_files(agg.run_dir, spec, files, logs)
    valid = validate(agg.run_dir) if do_validate else None
    usage = agg.rusage
    agg_cpu_total = usage.ru_utime + usage.ru_stime
    load_s = max(agg.exit_t - t0, spec.seconds) if agg.exit_t else spec.seconds
    cpu_load = agg_cpu_total - idle.cpu_s
    written = check.written_records
    result = RunResult(
        spec=spec,
        generated_records=check.generated_records,
        written_records=written,
        records_per_s=written / spec.seconds,
        offered_records_per_s=check.generated_records / spec.seconds,
        # The aggregator's own drops: its dropped_batches less what the generator reported.
        agg_dropped_batches=int(stats.get("dropped_batches", check.agg_dropped_batches))
        - check.sender_dropped_selected_batches,
        sender_dropped_batches=sum(r["sender_dropped_batches"] for r in results),
        cpu_s_per_1k=cpu_load / max(written, 1) * 1000,
        agg_cpu_cores=cpu_load / load_s,
        gen_cpu_cores=sum(r["cpu_s"] for r in results) / spec.seconds,
        # VmHWM of the aggregator's own address space (ru_maxrss of wait4 would include
        # the image of the process that forked it, before exec).
        peak_rss_mb=max((x.hwm for x in agg.samples), default=0) / 2**20,
        idle_rss_mb=idle.rss / 2**20,
        queue_hw_batches=int(stats.get("queue_high_water_batches", -1)),
        queue_hw_bytes=int(stats.get("queue_high_water_bytes", -1)),
        max_queue_bytes=int(stats.get("max_queue_bytes") or 0),
        # From the end of the load schedule to the aggregator's exit (final flush, drain,
        # finalize).
        drain_s=(agg.exit_t or gen_done) - (t0 + spec.seconds),
        gen_max_lag_s=max(r["max_lag_s"] for r in results),
        gen_max_flush_ms=max(r["max_flush_s"] for r in results) * 1000,
        gen_max_pending_kib=max(r["max_pending_bytes"] for r in results) / 1024,
        check=check,
        stats=stats,
        samples=agg.samples,
        t0=t0,
        valid=valid,
    )
    if not quiet:
        report(result)
    return result


def report(r: RunResult) -> None:
    s, c = r.spec, r.check
    print(
        f"load: {s.ranks} ranks ({s.nodes} nodes x {s.ranks_per_node}, {s.gpus} GPUs/node), "
        f"{s.steps_per_s:g} steps/s, {s.seconds:g} s, streams {','.join(s.wire_streams)}"
    )
    print(
        f"records: generated {r.generated_records:,} ({r.offered_records_per_s:,.0f}/s), "
        f"written {r.written_records:,} ({r.records_per_s:,.0f}/s)"
    )
    print(
        f"aggregator: {r.cpu_s_per_1k:.3f} CPU s per 1,000 records, {r.agg_cpu_cores:.2f} cores, "
        f"peak RSS {r.peak_rss_mb:.0f} MB (idle with all connections {r.idle_rss_mb:.0f} MB), "
        f"queue high water {r.queue_hw_batches:,} batches / {r.queue_hw_bytes / 2**20:.1f} MiB, "
        f"drain after load {r.drain_s:.2f} s"
    )
    print(
        f"dropped batches: aggregator {r.agg_dropped_batches:,}, generator {r.sender_dropped_batches:,} "
        f"({c.sender_dropped_records:,} records); generator: {r.gen_cpu_cores:.2f} cores, "
        f"max lag {r.gen_max_lag_s * 1000:.0f} ms, longest flush {r.gen_max_flush_ms:.1f} ms, "
        f"max unsent {r.gen_max_pending_kib:.0f} KiB per connection"
    )
    print(
        f"accounting: {'EXACT' if c.exact else 'NOT EXACT'}: written {c.written_records:,} + "
        f"in aggregator-dropped batches {c.missing_records:,} ({c.missing_batches:,} batches, "
        f"aggregator says {c.agg_dropped_batches - c.sender_dropped_selected_batches:,} of its "
        f"{c.agg_dropped_batches:,}, the rest reported by the generator) + in "
        "generator-dropped batches "
        f"{c.sender_dropped_records:,} = {c.written_records + c.missing_records + c.sender_dropped_records:,}"
        f" of {c.generated_records:,} generated; duplicates {c.duplicates}, partial batches "
        f"{c.partial_batches}, unexpected {c.unexpected}, closing lines "
        f"{'ok' if c.closing_ok else 'WRONG'}"
        + (f"; problems: {c.problems[:5]}" if c.problems else "")
    )
    if r.valid is not None:
        ok, secs, line = r.valid
        print(f"traceml validate: {'ok' if ok else 'FAILED'} ({secs:.0f} s): {line}")


def _final_line(r: RunResult, max_sustained: float) -> str:
    return (
        f"ranks={r.spec.ranks} steps_per_s={r.spec.steps_per_s:g} "
        f"records_per_s={r.records_per_s:.0f} dropped_batches={r.dropped} "
        f"peak_rss_mb={r.peak_rss_mb:.0f} max_sustained_records_per_s={max_sustained:.0f}"
    )


# -- modes --------------------------------------------------------------------------------


def find_max(args: argparse.Namespace, base: LoadSpec, logs_dir: Path) -> None:
    """Double the steps/s while every batch arrives, then bisect; each probe a fresh run."""
    best: RunResult | None = None
    lo, hi = 0.0, None
    steps = base.steps_per_s
    for probe in range(args.probes):
        if hi is not None:
            steps = (lo + hi) / 2
        spec = _replace(base, steps_per_s=round(steps, 1), seconds=args.probe_seconds)
        name = f"probe{probe}"
        r = run_once(
            spec,
            args.streams,
            logs_dir=logs_dir,
            run_name=name,
            procs=args.procs,
            bounds=args.bounds,
            do_validate=False,
            quiet=True,
        )
        verdict = "sustained" if r.sustained else "NOT sustained"
        print(
            f"probe {probe}: {spec.steps_per_s:g} steps/s -> offered {r.offered_records_per_s:,.0f}"
            f" written {r.records_per_s:,.0f} records/s, dropped {r.dropped:,}, "
            f"agg {r.agg_cpu_cores:.2f} cores ({r.cpu_s_per_1k:.3f} CPU s/1k), gen "
            f"{r.gen_cpu_cores:.2f} cores lag {r.gen_max_lag_s * 1000:.0f} ms, "
            f"queue hw {r.queue_hw_batches:,} / {r.queue_hw_bytes / 2**20:.1f} MiB, "
            f"drain {r.drain_s:.1f} s, peak RSS {r.peak_rss_mb:.0f} MB, "
            f"accounting {'exact' if r.check.exact else 'NOT EXACT'}: {verdict}",
            flush=True,
        )
        if not args.keep:
            shutil.rmtree(logs_dir / name, ignore_errors=True)
        if r.sustained:
            lo = spec.steps_per_s
            if best is None or r.records_per_s > best.records_per_s:
                best = r
            if hi is None:
                steps = spec.steps_per_s * 2
        else:
            hi = spec.steps_per_s
            if r.gen_max_lag_s >= 0.5 and r.dropped == 0:
                print(
                    "  (the generator fell behind its schedule: this probe measured the generator)"
                )
        if hi is not None and lo and hi - lo <= max(1.0, lo * 0.05):
            break
    if best is None:
        print("no probe was sustained")
        sys.exit(1)
    print("best sustained probe:")
    report(best)
    print(_final_line(best, best.records_per_s))


def soak(args: argparse.Namespace, spec: LoadSpec, logs_dir: Path) -> None:
    r = run_once(
        spec,
        args.streams,
        logs_dir=logs_dir,
        run_name="soak",
        procs=args.procs,
        bounds=args.bounds,
        do_validate=not args.no_validate,
        sample_interval_s=1.0,
    )
    warm = [s for s in r.samples if s.t - r.t0 >= args.warmup]
    loaded = [s for s in warm if s.t - r.t0 <= spec.seconds]
    if not loaded:
        print("soak: no samples after warm-up")
        sys.exit(1)
    ref = loaded[0]
    rss = [s.rss for s in loaded]
    fds = {s.fds for s in loaded}
    threads = {s.threads for s in loaded}
    drift = (max(rss) - ref.rss) / ref.rss
    print(
        f"soak: {len(loaded)} samples after {args.warmup:g} s warm-up: RSS {ref.rss / 2**20:.0f} MB "
        f"at warm-up end, min {min(rss) / 2**20:.0f} / max {max(rss) / 2**20:.0f} MB "
        f"(drift {drift * 100:+.1f}%: {'flat' if abs(drift) <= 0.10 else 'NOT flat'}), "
        f"fds {sorted(fds)}, threads {sorted(threads)} "
        f"({'no growth' if len(fds) == 1 and len(threads) == 1 else 'CHANGED'})"
    )
    minutes: dict[int, Sample] = {}
    for s in loaded:
        minutes.setdefault(int((s.t - r.t0) // 60), s)
    print(
        "soak: RSS by minute (MB): "
        + " ".join(f"{m}:{s.rss / 2**20:.0f}" for m, s in sorted(minutes.items()))
    )
    print(_final_line(r, r.records_per_s if r.sustained else 0))


def overload(args: argparse.Namespace, spec: LoadSpec, logs_dir: Path) -> None:
    r = run_once(
        spec,
        args.streams,
        logs_dir=logs_dir,
        run_name="overload",
        procs=args.procs,
        bounds=args.bounds,
        do_validate=not args.no_validate,
    )
    bound = r.max_queue_bytes
    growth = r.peak_rss_mb - r.idle_rss_mb
    limit = 1.2 * bound / 2**20
    print(
        f"overload: peak RSS {r.peak_rss_mb:.0f} MB = idle {r.idle_rss_mb:.0f} MB + "
        f"{growth:.0f} MB; queue bound {bound / 2**20:.0f} MiB (+20% = {limit:.0f} MB): "
        f"{'within' if growth <= limit else 'NOT within'}; growth / queue high water bytes = "
        f"{growth * 2**20 / max(r.queue_hw_bytes, 1):.2f}; generator never blocked "
        f"(non-blocking sockets; longest flush {r.gen_max_flush_ms:.1f} ms, "
        f"{r.sender_dropped_batches:,} batches dropped at the generator)"
    )
    print(_final_line(r, 0))


def _replace(spec: LoadSpec, **changes: Any) -> LoadSpec:
    return LoadSpec(**{**spec.__dict__, **changes})


# -- aggregator pause with real RankSenders -----------------------------------------------


def _pause_rank_main(
    spec: LoadSpec, token: str, address: tuple[str, int], rank: int, conn: Connection
) -> None:
    """One real rank: a RankSender and a fake training loop timing its steps."""
    from traceml_ai.transport import RankSender

    ident = spec.identity(rank)
    sender = RankSender(address, token, ident)
    connects = [0]
    original = sender._connect

    def counting_connect(timeout: float) -> None:
        connects[0] += 1
        original(timeout)

    sender._connect = counting_connect  # type: ignore[method-assign]
    local = rank % spec.ranks_per_node
    device = f"cuda:{local}"
    events = step_events(device)
    put = dict.fromkeys(WIRE_ORDER, 0)  # a real rank sends every stream
    t0 = conn.recv()
    while time.monotonic() < t0:
        time.sleep(0.001)
    sender.start()
    period = 1.0 / spec.steps_per_s
    steps: list[tuple[float, float, float]] = []
    next_sample = 0.0
    for k in range(spec.total_steps):
        due = t0 + k * period
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        begin = time.perf_counter()
        # The "training": a fixed amount of pure-Python work (holds the GIL, like a
        # Python training loop's own overhead).
        acc = 0
        for i in range(2_000):
            acc += i * i
        p0 = time.perf_counter()
        ts = time.time_ns()
        sender.put(
            "step_time", {"timestamp_unix_ns": ts, "seq": k, "step": k + 1, "events": events}
        )
        sender.put(
            "step_memory",
            {
                "timestamp_unix_ns": ts,
                "seq": k,
                "step": k + 1,
                "device": device,
                "peak_allocated_bytes": 10**9,
                "peak_reserved_bytes": 2 * 10**9,
            },
        )
        put["step_time"] += 1
        put["step_memory"] += 1
        if k == 0:
            sender.put("runtime_environment", runtime_item(ts, spec.ranks, spec.ranks_per_node))
            put["runtime_environment"] += 1
        if time.monotonic() - t0 >= next_sample:
            next_sample += spec.sampler_interval_s
            sender.put("process", process_item(put["process"], ts, local))
            put["process"] += 1
            if local == 0:
                sender.put("system", system_item(put["system"], ts, spec.gpus))
                put["system"] += 1
        end = time.perf_counter()
        steps.append((time.monotonic() - t0, end - begin, end - p0))
    sender.close(timeout=10)
    conn.send(
        {
            "rank": rank,
            "put": put,
            "steps": steps,
            "sent_items": sender.sent_items,
            "dropped_items": sender.dropped_items,
            "dropped_by_stream": sender.dropped_items_by_stream,
            "dropped_batches_by_stream": sender.dropped_batches_by_stream,
            "sent_batches": sender.sent_batches,
            "dropped_batches": sender.dropped_batches,
            "connects": connects[0],
        }
    )


def run_pause(
    spec: LoadSpec,
    streams: str,
    *,
    logs_dir: Path,
    pause_at: float,
    pause_s: float,
    do_validate: bool,
    bounds: QueueBounds | None = None,
) -> dict[str, Any]:
    """SIGSTOP the aggregator for ``pause_s`` seconds mid-run while real senders go on."""
    files = parse_export_streams(streams)
    token = f"pause-{os.getpid()}"
    agg = start_aggregator(logs_dir, "pause", spec, streams, token, bounds)
    ctx = mp.get_context("fork")
    procs = []
    for rank in range(spec.ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_pause_rank_main, args=(spec, token, agg.address, rank, child), daemon=True
        )
        p.start()
        procs.append((p, parent))
    agg.sample_every(0.25)
    t0 = time.monotonic() + 1.0
    for _, conn in procs:
        conn.send(t0)
    time.sleep(max(0.0, t0 + pause_at - time.monotonic()))
    os.kill(agg.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    time.sleep(pause_s)
    os.kill(agg.pid, signal.SIGCONT)
    resumed = time.monotonic()
    results = []
    for p, conn in procs:
        if not conn.poll(spec.seconds + 120):
            raise RuntimeError("a rank did not finish")
        results.append(conn.recv())
        p.join(10)
    if not agg.wait(120):
        agg.popen.send_signal(signal.SIGTERM)
        agg.wait(60)
    stats_path = agg.run_dir / "aggregator" / "stats.json"
    stats = orjson.loads(stats_path.read_bytes()) if stats_path.exists() else {}
    a, b = stopped - t0, resumed - t0
    windows: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for res in results:
        for t, step_s, _ in res["steps"]:
            key = "before" if t < a else "during" if t < b + 2.5 else "after"
            windows[key].append(step_s * 1000)
    # Accounting: per (rank, stream), the seqs written; missing = put - written.
    export = agg.run_dir / "aggregator" / "export"
    fields = {
        "step_time": ("global_rank", "seq"),
        "step_memory": ("global_rank", "seq"),
        "process": ("global_rank", "seq"),
        "system": ("node_rank", "seq"),
        "runtime_environment": ("global_rank", "seq"),
    }
    written = dup = missing_items = out_of_order = 0
    closing_dropped = set()
    for stream, flds in fields.items():
        if stream not in files:
            continue
        cols, closing = _read_keys(export / f"{stream}.jsonl", flds)
        if closing:
            closing_dropped.add(closing["dropped_batches"])
        keys = list(zip(*cols, strict=True))
        written += len(keys)
        dup += len(keys) - len(set(keys))
        last: dict[int, int] = {}
        for who, seq in keys:  # file order: a rank's seq never decreases
            out_of_order += seq < last.get(who, -1)
            last[who] = seq
        for res in results:
            rank = res["rank"]
            if stream == "system" and rank % spec.ranks_per_node:
                continue
            who = rank // spec.ranks_per_node if stream == "system" else rank
            seqs = {s for w, s in keys if w == who}
            n_put = res["put"][stream]
            dup += sum(1 for s in seqs if s >= n_put)
            missing_items += n_put - len(seqs)
    sender_dropped = sum(r["dropped_items"] for r in results)
    # Ranks send every stream; only the drops of exported ones can be missing from files.
    exported = batch_streams_for(files)
    sender_dropped_exported = sum(
        n for r in results for stream, n in r["dropped_by_stream"].items() if stream in exported
    )
    # The aggregator's dropped_batches includes what the senders reported dropping in
    # exported streams; only the rest was dropped by the aggregator itself.
    sender_dropped_exported_batches = sum(
        n
        for r in results
        for stream, n in r["dropped_batches_by_stream"].items()
        if stream in exported
    )
    agg_dropped = int(stats.get("dropped_batches", -1))
    queue_dropped = agg_dropped - sender_dropped_exported_batches
    return {
        "stopped_at": a,
        "paused_s": b - a,
        "windows": windows,
        "results": results,
        "stats": stats,
        "written": written,
        "duplicates": dup,
        "out_of_order": out_of_order,
        "missing_items": missing_items,
        "sender_dropped_items": sender_dropped,
        "sender_dropped_exported_items": sender_dropped_exported,
        "sender_dropped_batches": sum(r["dropped_batches"] for r in results),
        "agg_dropped_batches": agg_dropped,
        "sender_dropped_exported_batches": sender_dropped_exported_batches,
        "queue_dropped_batches": queue_dropped,
        "closing_dropped": sorted(closing_dropped),
        "exact": dup == 0
        and missing_items == sender_dropped_exported
        and queue_dropped == 0
        and closing_dropped <= {agg_dropped},
        "valid": validate(agg.run_dir) if do_validate else None,
        "peak_rss_mb": max((x.hwm for x in agg.samples), default=0) / 2**20,
    }


def pause(args: argparse.Namespace, spec: LoadSpec, logs_dir: Path) -> None:
    r = run_pause(
        spec,
        args.streams,
        logs_dir=logs_dir,
        pause_at=args.pause_at,
        pause_s=args.pause_s,
        do_validate=not args.no_validate,
        bounds=args.bounds,
    )
    results, stats = r["results"], r["stats"]
    print(
        f"pause: {spec.ranks} real RankSenders (one process each), {spec.steps_per_s:g} steps/s, "
        f"{spec.seconds:g} s; aggregator SIGSTOPped at {r['stopped_at']:.1f} s for "
        f"{r['paused_s']:.1f} s"
    )
    for key, vals in r["windows"].items():
        if vals:
            v = np.asarray(vals)
            print(
                f"  step body ({key:6s}; 'during' = pause + 2.5 s): n={len(v):,} p50 "
                f"{np.percentile(v, 50):.3f} ms p99 {np.percentile(v, 99):.3f} ms "
                f"max {v.max():.3f} ms"
            )
    print(
        f"  senders: {sum(x['sent_batches'] for x in results):,} batches sent, "
        f"{r['sender_dropped_batches']:,} dropped ({r['sender_dropped_items']:,} items); "
        f"connects per rank {sorted(x['connects'] for x in results)}"
    )
    print(
        f"  aggregator: dropped batches {r['agg_dropped_batches']} (reported by senders "
        f"{r['sender_dropped_exported_batches']}, its queue {r['queue_dropped_batches']}), "
        "rejected frames "
        f"{stats.get('rejected_by_reason', {})}, connections {stats.get('connections_total')} "
        f"(held behind an older one of the same rank: {stats.get('held_connections')}), "
        f"closing dropped_batches {r['closing_dropped']}"
    )
    print(
        f"  accounting: written {r['written']:,}, missing items {r['missing_items']:,} = dropped "
        f"by senders in exported streams {r['sender_dropped_exported_items']:,} (all streams "
        f"{r['sender_dropped_items']:,}) + aggregator-dropped "
        f"{'0' if r['queue_dropped_batches'] == 0 else '?'}: "
        f"{'EXACT' if r['exact'] else 'NOT EXACT'} (duplicates {r['duplicates']}, "
        f"seq out of order {r['out_of_order']})"
    )
    if r["valid"] is not None:
        ok, secs, line = r["valid"]
        print(f"  traceml validate: {'ok' if ok else 'FAILED'} ({secs:.0f} s): {line}")
    print(
        f"ranks={spec.ranks} steps_per_s={spec.steps_per_s:g} "
        f"records_per_s={r['written'] / spec.seconds:.0f} "
        f"dropped_batches={r['queue_dropped_batches'] + r['sender_dropped_batches']} "
        f"peak_rss_mb={r['peak_rss_mb']:.0f} max_sustained_records_per_s=0"
    )


# -- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--streams", default="all", help="export_streams of the aggregator")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per system snapshot")
    parser.add_argument("--flush-hz", type=float, default=4.0)
    parser.add_argument("--sampler-interval", type=float, default=2.0)
    parser.add_argument("--procs", type=int, default=2, help="generator processes")
    parser.add_argument("--sender-buffer-kib", type=int, default=4096)
    parser.add_argument("--logs-dir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("--no-validate", action="store_true")
    parser.add_argument(
        "--py-spy", type=Path, default=None, help="profile the aggregator into this raw file"
    )
    parser.add_argument("--summarize", type=Path, default=None, help="print a raw profile")
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--find-max", action="store_true")
    mode.add_argument("--overload", action="store_true", help="check memory vs queue bound")
    mode.add_argument("--soak", action="store_true", help="10 minutes, RSS/fd/thread samples")
    mode.add_argument("--pause", action="store_true", help="SIGSTOP the aggregator mid-run")
    parser.add_argument("--queue-batches", type=int, default=None, help="export queue bound")
    parser.add_argument("--queue-bytes", type=int, default=None, help="export queue bound")
    parser.add_argument("--queue-trace", type=Path, default=None, help="queue depth every 50 ms")
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--probe-seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--pause-at", type=float, default=5.0)
    parser.add_argument("--pause-s", type=float, default=5.0)
    args = parser.parse_args(argv)

    args.bounds = QueueBounds(args.queue_batches, args.queue_bytes, args.queue_trace)
    if args.soak and args.seconds == 60.0:
        args.seconds = 600.0
    rpn = min(args.ranks_per_node, args.ranks)
    if args.ranks % rpn:
        parser.error("--ranks must be a multiple of --ranks-per-node")
    files = parse_export_streams(args.streams)
    wire = tuple(s for s in WIRE_ORDER if s in batch_streams_for(files))
    spec = LoadSpec(
        ranks=args.ranks,
        steps_per_s=args.steps_per_s,
        seconds=args.seconds,
        ranks_per_node=rpn,
        gpus=args.gpus,
        flush_hz=args.flush_hz,
        sampler_interval_s=args.sampler_interval,
        wire_streams=wire,
        sender_buffer_bytes=args.sender_buffer_kib * 1024,
    )
    tmp = None
    if args.logs_dir is None:
        tmp = tempfile.mkdtemp(prefix="traceml-scale-")
        logs_dir = Path(tmp)
    else:
        logs_dir = args.logs_dir.resolve()
        logs_dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    try:
        if args.summarize:
            print_profile(args.summarize)
        elif args.find_max:
            find_max(args, spec, logs_dir)
        elif args.soak:
            soak(args, spec, logs_dir)
        elif args.overload:
            overload(args, spec, logs_dir)
        elif args.pause:
            pause(args, spec, logs_dir)
        else:
            r = run_once(
                spec,
                args.streams,
                logs_dir=logs_dir,
                run_name="scale",
                procs=args.procs,
                bounds=args.bounds,
                do_validate=not args.no_validate,
                during=py_spy(args.py_spy, spec.seconds) if args.py_spy else None,
            )
            if args.py_spy:
                summarize_profile(args.py_spy)
            print(_final_line(r, r.records_per_s if r.sustained else 0))
    finally:
        print(f"machine: load average {os.getloadavg()[0]:.2f} at end")
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
