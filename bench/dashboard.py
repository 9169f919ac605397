"""Aggregator CPU with the live dashboard's page open, against the dashboard unwatched.

Runs the scale benchmark's simulated load (``bench.scale``: real TCP connections, real
batches) against the aggregator as ``traceml serve`` runs it (same ``Aggregator`` and
``run_until_done``), with the dashboard on, twice per round: nobody on the page, then
an HTTP client fetching the page's JSON (``/api/view``) every second, as an open page
does — alternating, so the machine's noise hits both alike. Each run's aggregator CPU
per 1,000 records written is measured as ``bench.scale`` measures it (``wait4``'s CPU
time, less the idle CPU before the load). A third run per round has the dashboard off,
for reference.

    python -m bench.dashboard                      # 256 ranks, 10 steps/s, 20 s, 2 rounds
    python -m bench.dashboard --ranks 1024 --seconds 30 --rounds 1

Last line: ``dashboard_cpu_ratio=<median of watched/unwatched> view_ms=<median time to
answer /api/view> dropped_batches=<with the page open>``.

``--paint``: the page's first paint in Chromium instead, at 1,024 ranks (the baseline)
and 10,240 ranks, in process: the live state of ``bench.monitoring``'s job builder (8
ranks and 8 GPUs per node, each rank's last 120 steps) served by the real dashboard
server from :class:`~traceml_ai.dashboard._live.LiveSource`. Each load is cold: a new
server (so the view is built for it) and a new browser context (nothing cached). First
paint is ``window.tracemlFirstPaintMs``: ``performance.now()`` (ms since navigation
started) in the frame after the page rendered its first view, when it sets
``<html data-ready="1">``; the charts follow when Plotly has loaded
(``window.tracemlChartsMs``, printed with the load's other timings). Also printed: the
view's build time (the source's ``RunData``, ``build_view`` and the JSON, thread CPU
time, median of 3) and the ``/api/view`` JSON's size, of the full view and of the
page's first view (``?charts=0``: no lines over steps, which wait for Plotly anyway).
Last line: ``first_paint_s_1024=<median> view_bytes_1024=<n> view_build_s_1024=<median>
first_view_build_s_1024=<median>``, then the same for 10,240.

    python -m bench.dashboard --paint              # 3 loads per size
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from traceml_ai.dashboard._view import RunData, build_view
from traceml_ai.transport.wire import ENV_RUN_TOKEN

from .scale import run as scale_run
from .scale.aggregator import REPO, AggregatorProc, QueueBounds
from .scale.items import LoadSpec
from .scale.run import RunResult, run_once

# The aggregator as ``traceml serve`` runs it, with the dashboard on or off.
_SERVE = """
import os, sys, threading
from pathlib import Path
import orjson
from traceml_ai.aggregator import Aggregator, AggregatorConfig, run_until_done
from traceml_ai.settings import ExportSettings, MonitorSettings

cfg = orjson.loads(sys.argv[1])
aggregator = Aggregator(AggregatorConfig(
    run_dir=Path(cfg["run_dir"]),
    settings=ExportSettings(exporter="jsonl", export_streams=cfg["streams"], exporter_hostname=False),
    token=os.environ["TRACEML_RUN_TOKEN"],
    expected_world_size=cfg["ranks"],
    finalize_timeout_sec=60.0,
    monitor=MonitorSettings(dashboard=cfg["port"] is not None, dashboard_port=cfg["port"] or 0),
))
host, port = aggregator.start()
print(f"export TRACEML_AGGREGATOR_ADDR={host}:{port}", flush=True)
run_until_done(aggregator, stop=threading.Event(), wait_for_ranks=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _starter(dashboard_port: int | None):  # type: ignore[no-untyped-def]
    """A ``start_aggregator`` for ``bench.scale.run`` running :data:`_SERVE`."""

    def start(
        logs_dir: Path,
        run_name: str,
        spec: LoadSpec,
        export_streams: str,
        token: str,
        bounds: QueueBounds | None = None,
    ) -> AggregatorProc:
        del bounds
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
        env[ENV_RUN_TOKEN] = token
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO / "src"), env.get("PYTHONPATH", "")) if p
        )
        cfg = {
            "run_dir": str(logs_dir / run_name),
            "streams": export_streams,
            "ranks": spec.ranks,
            "port": dashboard_port,
        }
        popen = subprocess.Popen(
            [sys.executable, "-c", _SERVE, orjson.dumps(cfg).decode()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            cwd=logs_dir,
        )
        assert popen.stdout is not None
        line = popen.stdout.readline().decode()
        if "TRACEML_AGGREGATOR_ADDR=" not in line:
            popen.kill()
            err = popen.stderr.read().decode() if popen.stderr else ""
            raise RuntimeError(f"the aggregator did not start: {line!r} {err}")
        host, port = line.split("TRACEML_AGGREGATOR_ADDR=")[1].split()[0].rsplit(":", 1)
        return AggregatorProc(popen, logs_dir / run_name, (host, int(port)))

    return start


def one_run(
    spec: LoadSpec, logs: Path, name: str, *, dashboard: bool, watched: bool
) -> tuple[RunResult, list[float]]:
    port = _free_port() if dashboard else None
    answers: list[float] = []

    def watch_during(agg: AggregatorProc, t0: float) -> None:
        del agg

        def loop() -> None:
            time.sleep(max(0.0, t0 - time.monotonic()))
            end = t0 + spec.seconds
            while time.monotonic() < end:
                started = time.monotonic()
                try:
                    with urllib.request.urlopen(
                        f"http://127.0.0.1:{port}/api/view", timeout=10
                    ) as r:
                        r.read()
                    answers.append(time.monotonic() - started)
                except OSError:
                    pass
                time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))

        threading.Thread(target=loop, daemon=True).start()

    original = scale_run.start_aggregator
    scale_run.start_aggregator = _starter(port)
    try:
        result = run_once(
            spec, "all", logs_dir=logs, run_name=name, procs=2, do_validate=False,
            during=watch_during if watched else None, quiet=True,
        )  # fmt: skip
    finally:
        scale_run.start_aggregator = original
    return result, answers


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--paint", action="store_true", help="first paint in Chromium")
    parser.add_argument("--loads", type=int, default=3, help="--paint: page loads per size")
    parser.add_argument("--paint-ranks", type=int, nargs="*", help="--paint: the sizes")
    args = parser.parse_args()
    if args.paint:
        paint_main(args.loads, tuple(args.paint_ranks or PAINT_RANKS))
        return
    spec = LoadSpec(ranks=args.ranks, steps_per_s=args.steps_per_s, seconds=args.seconds)
    logs = Path(tempfile.mkdtemp(prefix="bench-dashboard-"))
    ratios: list[float] = []
    view_s: list[float] = []
    dropped = 0
    print(
        f"load: {spec.ranks} ranks, {spec.steps_per_s:g} steps/s, {spec.seconds:g} s, "
        "every stream exported"
    )
    try:
        for i in range(args.rounds):
            off, _ = one_run(spec, logs, f"off{i}", dashboard=False, watched=False)
            quiet, _ = one_run(spec, logs, f"quiet{i}", dashboard=True, watched=False)
            watched, answers = one_run(spec, logs, f"watched{i}", dashboard=True, watched=True)
            dropped += watched.dropped
            view_s.extend(answers)
            ratio = watched.cpu_s_per_1k / quiet.cpu_s_per_1k
            ratios.append(ratio)
            print(
                f"round {i + 1}: CPU s per 1,000 records: dashboard off {off.cpu_s_per_1k:.4f}, "
                f"on but unwatched {quiet.cpu_s_per_1k:.4f}, page open {watched.cpu_s_per_1k:.4f} "
                f"({len(answers)} views fetched, median "
                f"{statistics.median(answers) * 1000 if answers else float('nan'):.1f} ms); "
                f"ratio open/unwatched {ratio:.2f}, open/off "
                f"{watched.cpu_s_per_1k / off.cpu_s_per_1k:.2f}; dropped {watched.dropped}"
            )
    finally:
        shutil.rmtree(logs, ignore_errors=True)
    view_ms = statistics.median(view_s) * 1000 if view_s else float("nan")
    print(
        f"dashboard_cpu_ratio={statistics.median(ratios):.2f} view_ms={view_ms:.1f} "
        f"dropped_batches={dropped}"
    )


# -- first paint in Chromium ---------------------------------------------------------------

CHROMIUM = "/usr/bin/chromium"
"""Debian's chromium, driven by Playwright (as the page's tests drive it)."""
PAINT_RANKS = (1024, 10240)
"""The baseline size, then the size the first paint is asked of (``first_paint_s_10240``)."""


@dataclass(frozen=True)
class PaintCost:
    first_paint_s: list[float]
    view_bytes: int
    view_build_s: float
    first_view_build_s: float


def _view_cost(source: Callable[[], RunData], repeat: int, charts: bool) -> tuple[int, float]:
    """(the view's JSON bytes, the median thread CPU time of the source and the view)."""
    times, body = [], b""
    for _ in range(repeat):
        started = time.thread_time()
        body = orjson.dumps(build_view(source(), charts=charts))
        times.append(time.thread_time() - started)
    return len(body), statistics.median(times)


_TIMINGS = """() => {
  const at = {};
  const nav = performance.getEntriesByType("navigation")[0];
  at["page HTML received"] = nav.responseEnd;
  for (const r of performance.getEntriesByType("resource")) {
    const name = r.name.split("/").pop();
    if (name === "plotly.min.js") at["plotly.min.js received"] = r.responseEnd;
    if (name.startsWith("view") && !("first /api/view asked" in at)) {
      at["first /api/view asked"] = r.startTime;
      at["first /api/view received"] = r.responseEnd;
    }
  }
  at["first paint"] = window.tracemlFirstPaintMs;
  at["charts drawn"] = window.tracemlChartsMs;
  return at;
}"""
"""Performance timings of the load, ms since navigation started."""


def paint_cost(browser: Any, ranks: int, loads: int) -> PaintCost:
    from traceml_ai.dashboard._live import LiveSource
    from traceml_ai.dashboard._server import Views, start_server

    from .monitoring import _job_monitoring

    started = time.monotonic()
    monitoring = _job_monitoring(ranks)
    print(f"{ranks:,} ranks: live state built in {time.monotonic() - started:.1f} s")
    source = LiveSource(monitoring)
    nbytes, build_s = _view_cost(source, 3, charts=True)
    first_bytes, first_s = _view_cost(source, 3, charts=False)
    painted: list[float] = []
    timings: list[dict[str, float]] = []
    for _ in range(loads):
        server = start_server(Views(source, final=lambda: False), "127.0.0.1", 0)
        context = browser.new_context(viewport={"width": 1400, "height": 1500})
        try:
            page = context.new_page()
            page.goto(server.url)
            page.wait_for_function("() => document.documentElement.dataset.ready === '1'",
                                   timeout=120_000)  # fmt: skip
            painted.append(float(page.evaluate("() => window.tracemlFirstPaintMs")) / 1000)
            page.wait_for_function("() => document.documentElement.dataset.charts === '1'",
                                   timeout=120_000)  # fmt: skip
            timings.append(page.evaluate(_TIMINGS))
        finally:
            context.close()
            server.stop(2.0)
    print(
        f"{ranks:,} ranks: first paint {', '.join(f'{s:.2f}' for s in painted)} s "
        f"(median {statistics.median(painted):.2f} s); /api/view {nbytes / 1e3:,.0f} kB, "
        f"built in {build_s:.3f} s CPU (median of 3); the first view (?charts=0) "
        f"{first_bytes / 1e3:,.0f} kB, built in {first_s:.3f} s CPU"
    )
    for name in dict.fromkeys(k for t in timings for k in t):
        values = [f"{t[name] / 1000:.2f}" if t.get(name) is not None else "-" for t in timings]
        print(f"  {name}: {', '.join(values)} s")
    return PaintCost(painted, nbytes, build_s, first_s)


def paint_main(loads: int, sizes: tuple[int, ...]) -> None:
    from playwright.sync_api import sync_playwright

    costs: dict[int, PaintCost] = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        try:
            for ranks in sizes:
                costs[ranks] = paint_cost(browser, ranks, loads)
        finally:
            browser.close()
    print(
        " ".join(
            f"first_paint_s_{n}={statistics.median(c.first_paint_s):.3f} "
            f"view_bytes_{n}={c.view_bytes} view_build_s_{n}={c.view_build_s:.4f} "
            f"first_view_build_s_{n}={c.first_view_build_s:.4f}"
            for n, c in costs.items()
        )
    )


if __name__ == "__main__":
    main()
