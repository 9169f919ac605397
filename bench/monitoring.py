"""Aggregator CPU with the live views on: Prometheus and OTLP against JSONL alone.

Runs the scale benchmark's real ``traceml serve`` under the same simulated load
twice per round — JSONL alone, then JSONL with ``--prometheus-port`` and ``--otlp`` —
alternating, so the machine's noise hits both alike. With the views on, a thread
scrapes ``/metrics`` every ``--scrape-s`` seconds (15, Prometheus' default) and a loopback OTLP/HTTP receiver
takes the exports (metrics every ``--otlp-interval-s``, traces at the default sampling).

    python -m bench.monitoring                       # 256 ranks, 10 steps/s, 20 s, 2 rounds
    python -m bench.monitoring --ranks 1024 --seconds 30 --rounds 1   # the nominal scale run

Prints each run's aggregator CPU per 1,000 records, the dropped batches, and the last
line ``monitoring_cpu_ratio=<median of on/off> dropped_batches=<with the views on>``.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .scale.aggregator import AggregatorProc
from .scale.items import LoadSpec
from .scale.run import RunResult, run_once


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


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scrape-s", type=float, default=15.0, help="Prometheus' default")
    parser.add_argument("--otlp-interval-s", type=float, default=15.0)
    parser.add_argument("--views", choices=("both", "prometheus", "otlp"), default="both")
    args = parser.parse_args()
    spec = LoadSpec(ranks=args.ranks, steps_per_s=args.steps_per_s, seconds=args.seconds)
    logs = Path(tempfile.mkdtemp(prefix="bench-monitoring-"))
    ratios: list[float] = []
    dropped_on = 0
    try:
        with otlp_sink() as otlp_port:
            os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{otlp_port}"
            os.environ["OTEL_METRIC_EXPORT_INTERVAL"] = str(int(args.otlp_interval_s * 1000))
            for i in range(args.rounds):
                off = one_run(spec, logs, f"off{i}", views=False, scrape_s=args.scrape_s)
                on = one_run(
                    spec, logs, f"on{i}", views=True, scrape_s=args.scrape_s, which=args.views
                )
                dropped_on += on.dropped
                ratio = on.cpu_s_per_1k / off.cpu_s_per_1k if off.cpu_s_per_1k > 0 else float("nan")
                ratios.append(ratio)
                print(
                    f"round {i + 1}: JSONL alone {off.cpu_s_per_1k:.4f} CPU s per 1,000 records "
                    f"(dropped {off.dropped}); with Prometheus + OTLP {on.cpu_s_per_1k:.4f} "
                    f"(dropped {on.agg_dropped_batches} by the aggregator, "
                    f"{on.sender_dropped_batches} by the senders, exact {on.check.exact}); "
                    f"ratio {ratio:.2f}"
                )
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    print(f"monitoring_cpu_ratio={statistics.median(ratios):.2f} dropped_batches={dropped_on}")


if __name__ == "__main__":
    main()
