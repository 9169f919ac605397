"""Per-step overhead of TraceML on a small CPU training loop, and a stalled aggregator.

    python -m bench.overhead.step [--rounds 5] [--seconds 3]

1. The same loop (workloads/tiny_loop.py) runs alternately plain (``python``) and
   traced under ``traceml run --exporter jsonl --export-streams all``, ``--rounds``
   times each, interleaved so that machine noise hits both alike. Reported: the
   median step time of each (median over rounds of each round's median) and the
   microseconds TraceML adds per traced step.
2. A traced run whose aggregator process is frozen with SIGSTOP for a third of the
   run and then resumed: the median step time while it is frozen, divided by the
   median outside that window (1.0 means training did not notice).

Last line: ``overhead_us_per_step=<x> stalled_aggregator_ratio=<y>``. Figures only; no
pass/fail.

    python -m bench.overhead.step --paired [--rounds 5] [--seconds 3]

Paired mode, so that noise cannot hide the cost: one process under ``traceml run
--exporter jsonl --export-streams all`` (workloads/paired_loop.py) traces one
step in 4 of a ~700 µs CPU step with a DataLoader fetch; the figure is what a traced
step costs, its own extra time plus what spills into the untraced steps after it, over
the last untraced step of each cycle (``paired`` says why), per round, and the
median over rounds; also in the training thread's CPU time (``time.thread_time``),
which the other processes of a busy machine do not inflate. Each round also runs the
same loop with TraceML never started (``null``): the estimator's A/A figure (about 0
when it is unbiased), and the baseline of the whole cost: what a step costs when
every step is traced, against a step without TraceML, CPU time, which also counts
what every step pays while TraceML runs (hooks returning at once, the sender and
sampler threads); it compares separate processes, so it is the noisier figure. Last
line: ``paired_overhead_us=<x> step_us=<y> paired_overhead_cpu_us=<z>
whole_overhead_cpu_us=<w> null_paired_us=<a> null_paired_cpu_us=<b>``.

    python -m bench.overhead.step --paired --baseline-src /tmp/base/src

Before/after in one session: ``git archive <commit> src | tar -x -C /tmp/base`` (copy
the built ``traceml_records/_speedups*.so`` in too), then each round runs that tree
(``PYTHONPATH``, inherited by every process ``traceml run`` starts; the bench prints
which ``traceml_ai`` ran) and the current one; the last line adds
``baseline_paired_overhead_us=<b> baseline_paired_overhead_cpu_us=<c>``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import orjson
import psutil

from bench.overhead.paired import Cycle, cycle, positions

WORKLOADS = Path(__file__).resolve().parent / "workloads"
TRAIN = WORKLOADS / "tiny_loop.py"
PAIRED_TRAIN = WORKLOADS / "paired_loop.py"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _plain(out: Path, seconds: float) -> None:
    subprocess.run(
        [sys.executable, str(TRAIN), str(out), str(seconds)], env=_env(), check=True, timeout=120
    )


def _traced_cmd(tmp: Path, name: str, out: Path, seconds: float, script: Path = TRAIN) -> list[str]:
    return [
        sys.executable, "-m", "traceml_ai", "run",
        "--logs-dir", str(tmp / "logs"), "--run-name", name,
        "--exporter", "jsonl", "--export-streams", "all", "--interval", "0.5",
        str(script), str(out), str(seconds),
    ]  # fmt: skip


def _traced(tmp: Path, name: str, out: Path, seconds: float) -> None:
    subprocess.run(
        _traced_cmd(tmp, name, out, seconds), env=_env(), check=True, timeout=120,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _load(out: Path) -> dict[str, list[float]]:
    data: dict[str, list[float]] = orjson.loads(out.read_bytes())
    return data


def _median_us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def overhead(rounds: int, seconds: float, tmp: Path) -> tuple[float, float]:
    """(median plain step µs, median traced step µs)."""
    plain: list[float] = []
    traced: list[float] = []
    for i in range(rounds):
        out = tmp / f"plain{i}.json"
        _plain(out, seconds)
        plain.append(_median_us(_load(out)["durations"]))
        out = tmp / f"traced{i}.json"
        _traced(tmp, f"overhead{i}", out, seconds)
        traced.append(_median_us(_load(out)["durations"]))
        print(f"round {i + 1}: plain {plain[-1]:.1f} us, traced {traced[-1]:.1f} us", flush=True)
    return statistics.median(plain), statistics.median(traced)


# One traced step in ONE_IN (bench.overhead.paired): 4 leaves the last untraced step of a
# cycle clear of the traced step's after-effects (+10, +3, +0 µs after it, measured).
ONE_IN = 4


def _paired_round(
    tmp: Path, name: str, seconds: float, env: dict[str, str], null: bool = False
) -> tuple[Cycle, Cycle, str]:
    """One run: its figures in wall time and in the training thread's CPU time (µs),
    and the traceml_ai that ran. ``null``: the A/A run, TraceML never started."""
    out = tmp / f"{name}.json"
    cmd = [*_traced_cmd(tmp, name, out, seconds, PAIRED_TRAIN), str(ONE_IN)]
    cmd += ["null"] if null else []
    subprocess.run(cmd, env=env, check=True, timeout=180, stderr=subprocess.DEVNULL)
    data = orjson.loads(out.read_bytes())
    flags = data["traced"]
    where = positions(flags)
    # Skip the first steps: hooks are installed and caches warm on the first ones.
    skip = min(50, len(flags) // 10)
    wall = cycle([d * 1e6 for d in data["durations"]], where, ONE_IN, skip)
    cpu = cycle([c * 1e6 for c in data["cpu"]], where, ONE_IN, skip)
    return wall, cpu, str(data.get("traceml_file"))


def paired(
    rounds: int, seconds: float, tmp: Path, baseline: Path | None = None
) -> dict[str, tuple[float, float, float]]:
    """Per tree ("current", "baseline" when given, and "null", the A/A run): medians
    over rounds of (the cost of a traced step in wall µs, in CPU µs, the last untraced
    step of a cycle in wall µs); and "whole": the median over rounds of what a step
    costs when every step is traced, against a step without TraceML (CPU µs, the
    current tree's cost plus its last untraced step over the null run's step, which
    counts what every step pays while TraceML runs).

    With ``baseline`` (an old ``src/`` folder) each round runs it first with
    ``PYTHONPATH=baseline``, then the current tree, so both see the same machine. The
    null run comes last in each round.
    """
    trees: dict[str, dict[str, str]] = {"current": _env()}
    if baseline is not None:
        old = _env()
        old["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(baseline), old.get("PYTHONPATH", "")) if p
        )
        trees = {"baseline": old, **trees}
    trees["null"] = _env()
    figures: dict[str, list[tuple[float, float, float]]] = {tree: [] for tree in trees}
    whole: list[float] = []
    for i in range(rounds):
        current: Cycle | None = None
        for tree, env in trees.items():
            wall, cpu, ran = _paired_round(tmp, f"{tree}{i}", seconds, env, null=tree == "null")
            if i == 0 and tree != "null":
                print(f"{tree}: traceml {ran}", flush=True)
            figures[tree].append((wall.cost, cpu.cost, wall.by_position[-1]))
            print(
                f"round {i + 1} {tree}: a traced step costs {wall.cost:.1f} us (CPU time "
                f"{cpu.cost:.1f} us: own {cpu.own:.1f}, after it {cpu.spill:.1f}), last "
                f"untraced step {wall.by_position[-1]:.1f} us",
                flush=True,
            )
            if tree == "current":
                current = cpu
            elif tree == "null" and current is not None:
                null_step = statistics.median(cpu.by_position)
                whole.append(current.cost + current.by_position[-1] - null_step)
                print(
                    f"round {i + 1} whole: every step traced - no TraceML {whole[-1]:.1f} us "
                    f"(CPU time; untraced steps {current.by_position[-1] - null_step:+.1f} "
                    "us over the null run's, separate runs)",
                    flush=True,
                )
    result = {
        tree: (
            statistics.median(r[0] for r in rows),
            statistics.median(r[1] for r in rows),
            statistics.median(r[2] for r in rows),
        )
        for tree, rows in figures.items()
    }
    whole_us = statistics.median(whole)
    result["whole"] = (whole_us, whole_us, whole_us)
    return result


def _aggregator_of(launcher: psutil.Process, deadline: float) -> psutil.Process:
    while time.monotonic() < deadline:
        for child in launcher.children(recursive=True):
            try:
                if "traceml_ai.aggregator" in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        time.sleep(0.05)
    raise RuntimeError("aggregator process not found")


def stalled_ratio(seconds: float, tmp: Path) -> float:
    """Median step time while the aggregator is stopped / median outside that window."""
    out = tmp / "stalled.json"
    launcher = subprocess.Popen(
        _traced_cmd(tmp, "stalled", out, seconds), env=_env(), stderr=subprocess.DEVNULL
    )
    try:
        aggregator = _aggregator_of(psutil.Process(launcher.pid), time.monotonic() + 60)
        time.sleep(seconds / 3)
        stop_at = time.time()
        aggregator.send_signal(signal.SIGSTOP)
        time.sleep(seconds / 3)
        aggregator.send_signal(signal.SIGCONT)
        cont_at = time.time()
        launcher.wait(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    data = _load(out)
    inside = [
        d for s, d in zip(data["starts"], data["durations"], strict=True) if stop_at <= s < cont_at
    ]
    outside = [
        d
        for s, d in zip(data["starts"], data["durations"], strict=True)
        if not stop_at <= s < cont_at
    ]
    print(
        f"stalled aggregator: {len(inside)} steps while stopped, median {_median_us(inside):.1f} us; "
        f"{len(outside)} steps otherwise, median {_median_us(outside):.1f} us"
    )
    return statistics.median(inside) / statistics.median(outside)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each run")
    parser.add_argument(
        "--paired", action="store_true", help="traced and untraced steps alternating in one run"
    )
    parser.add_argument(
        "--baseline-src",
        type=Path,
        help="with --paired: an old tree's src/ folder (git archive <commit> src), run "
        "through PYTHONPATH alternately with the current tree, round by round",
    )
    args = parser.parse_args()
    if args.paired:
        with tempfile.TemporaryDirectory() as name:
            result = paired(args.rounds, args.seconds, Path(name), args.baseline_src)
        overhead_us, cpu_us, step_us = result["current"]
        last = (
            f"paired_overhead_us={overhead_us:.1f} step_us={step_us:.1f} "
            f"paired_overhead_cpu_us={cpu_us:.1f}"
        )
        if "baseline" in result:
            base_us, base_cpu_us, _ = result["baseline"]
            last += (
                f" baseline_paired_overhead_us={base_us:.1f}"
                f" baseline_paired_overhead_cpu_us={base_cpu_us:.1f}"
            )
        null_us, null_cpu_us, _ = result["null"]
        last += (
            f" whole_overhead_cpu_us={result['whole'][1]:.1f}"
            f" null_paired_us={null_us:.1f} null_paired_cpu_us={null_cpu_us:.1f}"
        )
        print(last)
        return
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        plain, traced = overhead(args.rounds, args.seconds, tmp)
        print(f"median step: plain {plain:.1f} us, traced {traced:.1f} us")
        ratio = stalled_ratio(max(args.seconds, 6.0), tmp)
    print(f"overhead_us_per_step={traced - plain:.1f} stalled_aggregator_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
