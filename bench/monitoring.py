"""Aggregator CPU with the live views on, and what one scrape costs at 1,024 ranks.

Runs the scale benchmark's real ``traceml serve`` under the same simulated load
twice per round — JSONL alone, then JSONL with ``--prometheus-port`` and ``--otlp`` —
alternating, so the machine's noise hits both alike. With the views on, a thread
scrapes ``/metrics`` every ``--scrape-s`` seconds (15, Prometheus' default) and a loopback OTLP/HTTP receiver
takes the exports (metrics every ``--otlp-interval-s``, traces at the default sampling).

    python -m bench.monitoring                       # 256 ranks, 10 steps/s, 20 s, 2 rounds
    python -m bench.monitoring --ranks 1024 --seconds 30 --rounds 1   # the nominal scale run

First, in process: the live state of a 1,024-rank job (8 ranks and 8 GPUs per node,
each rank's last 120 steps with the scale benchmark's phases, jittered, its memory
and process figures, each node's system sample) and the ``/metrics`` text a scrape
builds from it (``Monitoring.families`` and the exposition, as the endpoint does,
before gzip), the default against each rank's series served, in the same run; then
the default (bounded) scrape of a 10,240-rank job of the same shape.
``--rounds 0`` measures only these.

Prints each run's aggregator CPU per 1,000 records, the dropped batches, the scrape's
series, size and build time, and the last line ``monitoring_cpu_ratio=<median of
on/off> dropped_batches=<with the views on> scrape_series_1024=<n>
scrape_build_s_1024=<median build> scrape_build_ratio_1024=<default over each rank's
series> scrape_series_10240=<n> scrape_build_s_10240=<median build>`` (``monitoring_cpu_ratio=nan`` with ``--rounds 0``),
and with ``--baseline PATH`` (another checkout, e.g. ``../before``: its aggregator
runs the same rounds, the two trees taking turns) ``baseline_monitoring_cpu_ratio=``.
"""

from __future__ import annotations

import argparse
import gzip
import http.server
import json
import math
import os
import random
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from traceml_ai.monitor import WINDOW_STEPS, Monitoring, RunInfo
from traceml_ai.monitor.metrics import Health
from traceml_ai.monitor.prometheus import exposition
from traceml_ai.settings import MonitorSettings
from traceml_ai.testing import make_item

from .scale.aggregator import AggregatorProc
from .scale.items import LoadSpec, process_item, step_events, system_item
from .scale.run import RunResult, run_once

SCRAPE_RANKS = 1024
"""The job the scrape is measured on (the last line's ``_1024`` fields)."""
LARGE_RANKS = 10240
"""The large job whose bounded scrape is measured (the last line's ``_10240`` fields)."""


class _Sink(http.server.BaseHTTPRequestHandler):
    """Takes any OTLP/HTTP export and answers 200 with an empty protobuf."""

    received = 0

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self.rfile.read(length)
        type(self).received += 1
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        del format, args


@contextmanager
def otlp_sink() -> Iterator[int]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Sink)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


HERE = Path(__file__).resolve().parents[1]
"""This checkout: its aggregator is the one measured (``--baseline`` names another)."""


@contextmanager
def _tree(root: Path) -> Iterator[None]:
    """The aggregator (and the load's processes) started meanwhile import ``root``'s
    tree: its ``src`` and itself on ``PYTHONPATH``."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = f"{root}/src{os.pathsep}{root}"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = before


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def one_run(
    spec: LoadSpec, logs: Path, name: str, *, views: bool, scrape_s: float, which: str = "both"
) -> RunResult:
    if not views:
        os.environ.pop("SCALE_AGGREGATOR_ARGS", None)
        return run_once(
            spec, "all", logs_dir=logs, run_name=name, procs=2, do_validate=False, quiet=True
        )
    port = _free_port()
    flags = {"both": f"--prometheus-port {port} --otlp", "prometheus": f"--prometheus-port {port}"}
    os.environ["SCALE_AGGREGATOR_ARGS"] = flags.get(which, "--otlp")
    scrapes = [0]

    def scrape_during(agg: AggregatorProc, t0: float) -> None:
        del agg

        def loop() -> None:
            time.sleep(max(0.0, t0 - time.monotonic()))
            end = t0 + spec.seconds
            while time.monotonic() < end:
                try:
                    with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/metrics", timeout=10
                    ) as r:
                        r.read()
                    scrapes[0] += 1
                except OSError:
                    pass
                time.sleep(scrape_s)

        threading.Thread(target=loop, daemon=True).start()

    try:
        result = run_once(
            spec, "all", logs_dir=logs, run_name=name, procs=2, do_validate=False,
            during=scrape_during, quiet=True,
        )  # fmt: skip
    finally:
        os.environ.pop("SCALE_AGGREGATOR_ARGS", None)
    stats_path = logs / name / "aggregator" / "stats.json"
    live = json.loads(stats_path.read_text()).get("monitoring") if stats_path.exists() else None
    print(
        f"  scrapes: {scrapes[0]}, OTLP exports received: {_Sink.received}, live views lost: {live}"
    )
    return result


# -- one scrape at 1,024 ranks ------------------------------------------------------------


def _jittered(events: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The phases with each time scaled by 0.6 to 1.8, so the buckets differ by rank."""
    out: dict[str, Any] = {}
    for name, devices in events.items():
        out[name] = {}
        for device, t in devices.items():
            k = rng.uniform(0.6, 1.8)
            out[name][device] = {
                **t,
                "cpu_ms": t["cpu_ms"] * k,
                "duration_ms": t["duration_ms"] * k,
                "gpu_ms": None if t["gpu_ms"] is None else t["gpu_ms"] * k,
            }
    return out


def _job_monitoring(ranks: int, per_node: int = 8) -> Monitoring:
    """A Monitoring whose live state holds a job of ``ranks`` ranks."""
    health = Health(
        written_records={"step_time": ranks * WINDOW_STEPS},
        failed_records={"step_time": 0},
        expected_ranks=ranks,
        reporting_ranks=ranks,
    )
    # Every rank's histograms kept (the bound at the job's ranks): the scrapes swap the
    # settings to serve the default (bounded) set and every rank's series from it.
    monitoring = Monitoring(
        MonitorSettings(prometheus_port=0, rank_series_max_ranks=ranks),
        RunInfo(run_dir=Path("."), run_name="bench", host="bench"),
        lambda: health,
    )
    state, rng, t0 = monitoring.state, random.Random(0), time.time_ns()
    for rank in range(ranks):
        local = rank % per_node
        identity = {
            "global_rank": rank,
            "local_rank": local,
            "world_size": ranks,
            "local_world_size": per_node,
            "node_rank": rank // per_node,
        }
        device = f"cuda:{local}"
        steps = [
            {
                "seq": n,
                "step": n,
                "timestamp_unix_ns": t0 + n * 30_000_000,
                "events": _jittered(step_events(device), rng),
            }
            for n in range(1, WINDOW_STEPS + 1)
        ]
        state.add_steps(identity, steps)
        state.add_memory(identity, [make_item("step_memory", 0, device=device, step=WINDOW_STEPS)])
        state.add_process(identity, [process_item(0, t0, local)])
        if local == 0:
            state.add_system(identity, [system_item(0, t0, per_node)])
    return monitoring


@dataclass(frozen=True)
class ScrapeCost:
    series: int
    nbytes: int
    gzipped_bytes: int
    build_s: float
    """The median time to build the text (the families and the exposition): CPU time of
    the building thread, which another process's load on a shared machine leaves out."""


def _build(monitoring: Monitoring, max_ranks: int) -> tuple[bytes, float]:
    monitoring.settings = MonitorSettings(prometheus_port=0, rank_series_max_ranks=max_ranks)
    started = time.thread_time()
    body = exposition(monitoring.families()).encode("utf-8", "replace")
    return body, time.thread_time() - started


def _cost(body: bytes, times: list[float]) -> ScrapeCost:
    series = sum(1 for line in body.splitlines() if not line.startswith(b"#"))
    gzipped = len(gzip.compress(body, compresslevel=1))
    return ScrapeCost(series, len(body), gzipped, statistics.median(times))


def _otlp_export_cost(monitoring: Monitoring, repeat: int) -> str:
    """One OTLP metric export's making: the families, the SDK's objects, the protobuf."""
    try:
        from opentelemetry.exporter.otlp.proto.common.metrics_encoder import encode_metrics
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.util.instrumentation import InstrumentationScope

        from traceml_ai.monitor.otlp import build_metrics_data
    except ImportError:
        return "OTLP export: not measured (the 'otel' extra is not installed)"
    resource, scope = Resource.create({"service.name": "traceml"}), InstrumentationScope("b")
    times: dict[str, list[float]] = {"families": [], "SDK objects": [], "protobuf": []}
    size = 0
    for _ in range(repeat):
        t0 = time.thread_time()
        families = monitoring.families()
        t1 = time.thread_time()
        data = build_metrics_data(families, resource, scope, 0, time.time_ns())
        t2 = time.thread_time()
        size = len(encode_metrics(data).SerializeToString())
        t3 = time.thread_time()
        for key, took in zip(times, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            times[key].append(took)
    parts = ", ".join(f"{k} {statistics.median(v):.3f} s" for k, v in times.items())
    total = sum(statistics.median(v) for v in times.values())
    return f"one OTLP metric export: {total:.3f} s ({parts}), {size / 1e6:.2f} MB"


def scrape_costs(repeat: int = 9) -> tuple[ScrapeCost, ScrapeCost, str]:
    """(the default scrape, the scrape with each rank's histograms, the OTLP export's
    cost in words) at 1,024 ranks; the two scrapes alternate, so that the machine's
    moments hit both alike."""
    monitoring = _job_monitoring(SCRAPE_RANKS)
    bodies: dict[int, bytes] = {}
    times: dict[int, list[float]] = {
        MonitorSettings().rank_series_max_ranks: [],
        SCRAPE_RANKS: [],
    }
    for _ in range(repeat):
        for bound, took in times.items():
            bodies[bound], spent = _build(monitoring, bound)
            took.append(spent)
    default, detailed = (_cost(bodies[b], t) for b, t in times.items())
    monitoring.settings = MonitorSettings(prometheus_port=0)
    return default, detailed, _otlp_export_cost(monitoring, repeat)


def large_scrape_cost(repeat: int = 5) -> ScrapeCost:
    """The default (bounded) scrape at :data:`LARGE_RANKS` ranks, same state shape."""
    monitoring = _job_monitoring(LARGE_RANKS)
    bound = MonitorSettings().rank_series_max_ranks
    body, times = b"", []
    for _ in range(repeat):
        body, spent = _build(monitoring, bound)
        times.append(spent)
    return _cost(body, times)


def _describe(cost: ScrapeCost) -> str:
    return (
        f"{cost.series:,} series, {cost.nbytes / 1e6:.2f} MB "
        f"({cost.gzipped_bytes / 1e3:.0f} kB gzipped), built in {cost.build_s:.3f} s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2, help="0: the scrape's cost only")
    parser.add_argument("--scrape-s", type=float, default=15.0, help="Prometheus' default")
    parser.add_argument("--otlp-interval-s", type=float, default=15.0)
    parser.add_argument("--views", choices=("both", "prometheus", "otlp"), default="both")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=None,
        help="another checkout (e.g. ../before): its aggregator runs too, in alternation",
    )
    args = parser.parse_args()
    default, detailed, otlp = scrape_costs()
    scrape_ratio = default.build_s / detailed.build_s
    print(
        f"one scrape at {SCRAPE_RANKS:,} ranks (8 per node, 8 GPUs per node, "
        f"{WINDOW_STEPS} steps each), median of 9, CPU time: {_describe(default)}; with each rank's "
        f"histograms {_describe(detailed)}; ratio {scrape_ratio:.2f}"
    )
    print(otlp)
    large = large_scrape_cost()
    print(f"one scrape at {LARGE_RANKS:,} ranks (same shape), median of 5: {_describe(large)}")
    spec = LoadSpec(ranks=args.ranks, steps_per_s=args.steps_per_s, seconds=args.seconds)
    logs = Path(tempfile.mkdtemp(prefix="bench-monitoring-"))
    ratios: list[float] = []
    baseline_ratios: list[float] = []
    dropped_on = 0
    try:
        with otlp_sink() as otlp_port:
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{otlp_port}"
            os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = str(int(args.otlp_interval_s * 1000))
            trees = [("", HERE)] + ([("baseline ", args.baseline)] if args.baseline else [])
            for i in range(args.rounds):
                # With a baseline, the two trees take turns first, round by round.
                for label, tree in trees if i % 2 == 0 else trees[::-1]:
                    with _tree(tree):
                        off = one_run(
                            spec, logs, f"{label}off{i}", views=False, scrape_s=args.scrape_s
                        )
                        on = one_run(
                            spec, logs, f"{label}on{i}", views=True, scrape_s=args.scrape_s,
                            which=args.views,
                        )  # fmt: skip
                    ratio = on.cpu_s_per_1k / off.cpu_s_per_1k if off.cpu_s_per_1k > 0 else math.nan
                    if label:
                        baseline_ratios.append(ratio)
                    else:
                        dropped_on += on.dropped
                        ratios.append(ratio)
                    print(
                        f"round {i + 1}: {label}JSONL alone {off.cpu_s_per_1k:.4f} CPU s per 1,000 records "
                        f"(dropped {off.dropped}); with Prometheus + OTLP {on.cpu_s_per_1k:.4f} "
                        f"(dropped {on.agg_dropped_batches} by the aggregator, "
                        f"{on.sender_dropped_batches} by the senders, exact {on.check.exact}); "
                        f"ratio {ratio:.2f}"
                    )
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    cpu_ratio = statistics.median(ratios) if ratios else math.nan
    print(
        f"monitoring_cpu_ratio={cpu_ratio:.2f} dropped_batches={dropped_on} "
        f"scrape_series_{SCRAPE_RANKS}={default.series} "
        f"scrape_build_s_{SCRAPE_RANKS}={default.build_s:.4f} "
        f"scrape_build_ratio_{SCRAPE_RANKS}={scrape_ratio:.3f} "
        f"scrape_series_{LARGE_RANKS}={large.series} "
        f"scrape_build_s_{LARGE_RANKS}={large.build_s:.4f}"
        + (
            f" baseline_monitoring_cpu_ratio={statistics.median(baseline_ratios):.2f}"
            if baseline_ratios
            else ""
        )
    )


if __name__ == "__main__":
    main()
