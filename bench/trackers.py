"""Aggregator CPU with the experiment trackers on, against JSONL export alone.

Runs the scale benchmark's real ``traceml serve`` (``bench/scale/``) under the same
simulated load twice per round, each in its own aggregator process: JSONL alone, and
JSONL with ``--tracker`` naming every tracker TraceML knows
(``traceml_ai.settings.TRACKER_NAMES``), the order of the two alternating from round to
round so that the machine's noise hits both alike. Each tracker writes where a user's
would: TensorBoard its event files in the run folder; MLflow to a real ``mlflow server``
on sqlite that this bench starts (``bench/mlflow_server.py``), or one already running
(``--mlflow-uri``; its CPU is its own process's, not the aggregator's); W&B offline
(``WANDB_MODE=offline``) into a temporary ``WANDB_DIR``.

The figure is the aggregator process's own CPU time (user + system, from ``wait4`` at
its exit, less what it had used before the load) per 1,000 records written, with the
trackers over without. Before the load starts, each aggregator is left to settle (its
CPU idle for a second): the trackers' one-time start (importing MLflow takes seconds)
is printed apart, as ``start-up``, and is not in the ratio.

    python -m bench.trackers                          # 256 ranks, 10 steps/s, 30 s, 3 rounds
    python -m bench.trackers --ranks 1024 --seconds 60 --rounds 2
    python -m bench.trackers --mlflow-uri http://127.0.0.1:5000   # a server already up

Prints each round's figures and, last, ``trackers_cpu_ratio=<median of on/off>
trackers=<names> ranks=<n> steps_per_s=<s> every_steps=<k> points=<fewest points a
tracker logged in a run> startup_cpu_s=<median extra CPU before the load>``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import socket
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from traceml_ai.monitor import tracker_metrics as tm
from traceml_ai.settings import TRACKER_NAMES, MonitorSettings

from .mlflow_server import mlflow_server, server_env
from .scale.aggregator import AggregatorProc
from .scale.items import LoadSpec
from .scale.pyspy import py_spy, summarize_profile
from .scale.run import RunResult, run_once
from .wandb_files import history, of_type, records, run_folders

EXPERIMENT = "bench-trackers"
"""The MLflow experiment the runs go to."""

SETTLE_CPU_S = 0.03
"""An aggregator is settled when it used less CPU than this in the last second."""

SETTLE_TIMEOUT_S = 90.0


@dataclass
class Run:
    """One aggregator's run: the scale benchmark's figures and the trackers' points."""

    result: RunResult
    startup_cpu_s: float
    """The aggregator's CPU from its start to the load's (settled)."""
    points: dict[str, int | None] = field(default_factory=dict)
    """Points each tracker holds, read back (None: this bench cannot read it)."""
    lost: dict[str, object] = field(default_factory=dict)
    """``stats.json``'s ``monitoring.by_sink``: what each tracker lost."""

    @property
    def load_cpu_s(self) -> float:
        return self.result.cpu_s_per_1k * max(self.result.written_records, 1) / 1000


def settle(record: list[float]) -> Callable[[AggregatorProc], None]:
    """A ``before_load`` hook: wait until the aggregator's CPU is idle for a second (its
    trackers opened), then note its CPU so far in ``record``."""

    def wait(agg: AggregatorProc) -> None:
        proc = psutil.Process(agg.pid)

        def cpu() -> float:
            t = proc.cpu_times()
            return float(t.user + t.system)

        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        before = cpu()
        while time.monotonic() < deadline:
            time.sleep(1.0)
            now = cpu()
            if now - before < SETTLE_CPU_S:
                break
            before = now
        record.append(cpu())

    return wait


def tensorboard_points(run_dir: Path) -> int:
    """Points in the run's TensorBoard event files."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from traceml_ai.monitor._tracker_tensorboard import LOG_DIR_PARTS

    reader = EventAccumulator(str(run_dir.joinpath(*LOG_DIR_PARTS)))
    reader.Reload()
    if tm.STEP_TIME_MEDIAN.name not in reader.Tags().get("scalars", []):
        return 0
    return len(reader.Scalars(tm.STEP_TIME_MEDIAN.name))


def wandb_points(folder: Path, run_name: str) -> int:
    """Points of the offline W&B run named ``run_name`` under ``folder`` (``WANDB_DIR``),
    read back with W&B's own ``wandb leet inspect`` (0 when there is none)."""
    for run in run_folders(folder):
        found = records(run)
        if any(r.get("display_name") == run_name for r in of_type(found, "run")):
            return len(history(found).get(tm.STEP_TIME_MEDIAN.name, []))
    return 0


def mlflow_points(url: str, run_name: str) -> int:
    """Points of the MLflow run named ``run_name`` (0 when there is none)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=url)
    experiment = client.get_experiment_by_name(EXPERIMENT)
    if experiment is None:
        return 0
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"attributes.run_name = '{run_name}'"
    )
    if not runs:
        return 0
    history = client.get_metric_history(runs[0].info.run_id, tm.STEP_TIME_MEDIAN.name)
    return len(history)


def one_run(
    spec: LoadSpec,
    logs: Path,
    name: str,
    *,
    trackers: tuple[str, ...],
    every: int,
    mlflow_url: str | None,
    feed: bool = False,
    profile: Path | None = None,
) -> Run:
    """One aggregator under the load, with ``trackers`` (none: JSONL alone; ``feed``:
    the live state kept, for a ``/metrics`` endpoint nobody scrapes)."""
    if trackers:
        flags = f"--tracker {','.join(trackers)} --tracker-every-steps {every}"
        os.environ["SCALE_AGGREGATOR_ARGS"] = flags
    elif feed:
        os.environ["SCALE_AGGREGATOR_ARGS"] = f"--prometheus-port {_free_port()}"
    else:
        os.environ.pop("SCALE_AGGREGATOR_ARGS", None)
    startup: list[float] = []
    try:
        result = run_once(
            spec, "all", logs_dir=logs, run_name=name, procs=2, do_validate=False,
            before_load=settle(startup), quiet=True,
            during=None if profile is None else py_spy(profile, spec.seconds),
        )  # fmt: skip
    finally:
        os.environ.pop("SCALE_AGGREGATOR_ARGS", None)
    run = Run(result, startup[0] if startup else math.nan)
    stats_path = logs / name / "aggregator" / "stats.json"
    if stats_path.exists():
        monitoring = json.loads(stats_path.read_text()).get("monitoring") or {}
        run.lost = dict(monitoring.get("by_sink") or {})
    for tracker in trackers:
        if tracker == "tensorboard":
            run.points[tracker] = tensorboard_points(logs / name)
        elif tracker == "mlflow" and mlflow_url is not None:
            run.points[tracker] = mlflow_points(mlflow_url, name)
        elif tracker == "wandb" and os.environ.get("WANDB_DIR"):
            run.points[tracker] = wandb_points(Path(os.environ["WANDB_DIR"]), name)
        else:
            run.points[tracker] = None
    return run


@contextlib.contextmanager
def tracker_environment(
    trackers: tuple[str, ...], folder: Path, mlflow_uri: str | None = None
) -> Iterator[str | None]:
    """Where each tracker writes, set in this process's environment (the aggregator
    inherits it); yields the MLflow server's URL when MLflow is among ``trackers``:
    ``mlflow_uri``'s, a server already running, or else one started here."""
    saved = dict(os.environ)
    try:
        if "wandb" in trackers:
            wandb_dir = folder / "wandb"
            wandb_dir.mkdir()
            os.environ.update({"WANDB_MODE": "offline", "WANDB_DIR": str(wandb_dir)})
            os.environ.setdefault("WANDB_SILENT", "true")
        if "mlflow" not in trackers:
            yield None
            return
        with contextlib.ExitStack() as stack:
            if mlflow_uri is None:
                store = folder / "mlflow"
                store.mkdir()
                mlflow_uri = stack.enter_context(mlflow_server(store)).url
            clients = ("MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK", "NO_PROXY", "no_proxy")
            env = server_env()
            os.environ.update({k: env[k] for k in clients})
            os.environ["MLFLOW_TRACKING_URI"] = mlflow_uri
            os.environ["MLFLOW_EXPERIMENT_NAME"] = EXPERIMENT
            yield mlflow_uri
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ratio(a: Run, b: Run) -> float:
    base = b.result.cpu_s_per_1k
    return a.result.cpu_s_per_1k / base if base > 0 else math.nan


def _describe(run: Run) -> str:
    r = run.result
    return (
        f"{run.load_cpu_s:.2f} CPU s under load ({r.cpu_s_per_1k:.4f} per 1,000 records, "
        f"{r.written_records:,} written, dropped {r.dropped}, exact {r.check.exact}), "
        f"start-up {run.startup_cpu_s:.2f} s"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps-per-s", type=float, default=10.0, help="bench.scale's default")
    parser.add_argument("--seconds", type=float, default=30.0, help="of load, per run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--every",
        type=int,
        default=MonitorSettings().tracker_every_steps,
        help="--tracker-every-steps (default: TraceML's)",
    )
    parser.add_argument(
        "--trackers",
        default=",".join(TRACKER_NAMES),
        help="comma list (default: every tracker TraceML knows)",
    )
    parser.add_argument(
        "--feed",
        action="store_true",
        help="a third run per round: the live state alone (what every live view costs)",
    )
    parser.add_argument(
        "--py-spy", type=Path, default=None, help="profile the last round's run with trackers"
    )
    parser.add_argument("--logs-dir", type=Path, default=None, help="kept; default: temporary")
    parser.add_argument(
        "--mlflow-uri",
        default=None,
        help="an MLflow server already running (its tracking URI); default: one started here",
    )
    args = parser.parse_args(argv)
    trackers = tuple(t for t in args.trackers.split(",") if t)
    unknown = [t for t in trackers if t not in TRACKER_NAMES]
    if not trackers or unknown:
        parser.error(f"--trackers: expected names from {', '.join(TRACKER_NAMES)}")
    spec = LoadSpec(ranks=args.ranks, steps_per_s=args.steps_per_s, seconds=args.seconds)
    print(
        f"load: {spec.ranks} ranks ({spec.nodes} nodes x {spec.ranks_per_node}), "
        f"{spec.steps_per_s:g} steps/s, {spec.seconds:g} s per run, every stream; trackers "
        f"{', '.join(trackers)} every {args.every} steps; {args.rounds} rounds"
    )
    folder = Path(tempfile.mkdtemp(prefix="bench-trackers-"))
    logs = args.logs_dir or folder / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    ratios: list[float] = []
    own: list[float] = []
    startups: list[float] = []
    points: list[int] = []
    kinds = ["off", "on"] + (["feed"] if args.feed else [])
    try:
        with tracker_environment(trackers, folder, args.mlflow_uri) as mlflow_url:
            for i in range(args.rounds):
                order = kinds[i % len(kinds) :] + kinds[: i % len(kinds)]
                runs: dict[str, Run] = {}
                for kind in order:
                    profile = args.py_spy if kind == "on" and i == args.rounds - 1 else None
                    runs[kind] = one_run(
                        spec, logs, f"{kind}{i}-{os.getpid()}",
                        trackers=trackers if kind == "on" else (), every=args.every,
                        mlflow_url=mlflow_url, feed=kind == "feed", profile=profile,
                    )  # fmt: skip
                off, on = runs["off"], runs["on"]
                ratio = _ratio(on, off)
                ratios.append(ratio)
                startups.append(on.startup_cpu_s - off.startup_cpu_s)
                points += [n for n in on.points.values() if n is not None]
                print(f"round {i + 1}: JSONL alone {_describe(off)}")
                print(f"  with {'+'.join(trackers)} {_describe(on)}")
                line = f"  points logged {on.points}, lost {on.lost}; ratio {ratio:.3f}"
                if "feed" in runs:
                    own.append(_ratio(on, runs["feed"]))
                    print(f"  the live state alone (--prometheus-port, not scraped) "
                          f"{_describe(runs['feed'])}; ratio to JSONL alone "
                          f"{_ratio(runs['feed'], off):.3f}")  # fmt: skip
                    line += f", over the live state alone {own[-1]:.3f}"
                print(line)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # the MLflow store; --logs-dir is kept
    if args.py_spy is not None:
        summarize_profile(args.py_spy)
    cpu_ratio = statistics.median(ratios) if ratios else math.nan
    startup = statistics.median(startups) if startups else math.nan
    print(
        f"trackers_cpu_ratio={cpu_ratio:.3f} trackers={','.join(trackers)} ranks={spec.ranks} "
        f"steps_per_s={spec.steps_per_s:g} every_steps={args.every} "
        f"points={min(points, default=0)} startup_cpu_s={startup:.2f}"
        + (f" trackers_over_live_state={statistics.median(own):.3f}" if own else "")
    )


if __name__ == "__main__":
    main()
