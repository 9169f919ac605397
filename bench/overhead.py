"""Per-step overhead of TraceML on a small CPU training loop, and a stalled aggregator.

    python bench/overhead.py [--rounds 5] [--seconds 3]

1. The same loop (bench/_overhead_train.py) runs alternately plain (``python``) and
   traced under ``traceml run --exporter jsonl --export-streams all``, ``--rounds``
   times each, interleaved so that machine noise hits both alike. Reported: the
   median step time of each (median over rounds of each round's median) and the
   microseconds TraceML adds per traced step.
2. A traced run whose aggregator process is frozen with SIGSTOP for a third of the
   run and then resumed: the median step time while it is frozen, divided by the
   median outside that window (1.0 means training did not notice).

Last line: ``overhead_us_per_step=<x> stalled_aggregator_ratio=<y>``. Figures only; no
pass/fail.

    python bench/overhead.py --paired [--rounds 5] [--seconds 3]

Paired mode, so that noise cannot hide the cost: one process under ``traceml run
--exporter jsonl --export-streams all`` (bench/_overhead_paired_train.py) alternates
traced and untraced steps of a ~600 µs CPU step with a DataLoader fetch; the figure is
the median of (traced step - the next untraced step), per round, and the median over
rounds; also in the training thread's CPU time (``time.thread_time``), which the other
processes of a busy machine do not inflate. Last line: ``paired_overhead_us=<x>
step_us=<y> paired_overhead_cpu_us=<z>``.
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

HERE = Path(__file__).resolve().parent
TRAIN = HERE / "_overhead_train.py"
PAIRED_TRAIN = HERE / "_overhead_paired_train.py"


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


def _pair_diffs(values: list[float], traced_flags: list[bool], start: int) -> list[float]:
    return [
        values[j] - values[j + 1]
        for j in range(start, len(values) - 1)
        if traced_flags[j] and not traced_flags[j + 1]
    ]


def paired(rounds: int, seconds: float, tmp: Path) -> tuple[float, float, float]:
    """(median µs of traced step - next untraced step, median untraced step µs, the
    first figure in the training thread's CPU time)."""
    overheads: list[float] = []
    cpu_overheads: list[float] = []
    steps: list[float] = []
    for i in range(rounds):
        out = tmp / f"paired{i}.json"
        subprocess.run(
            _traced_cmd(tmp, f"paired{i}", out, seconds, PAIRED_TRAIN),
            env=_env(), check=True, timeout=180, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        data = orjson.loads(out.read_bytes())
        traced_flags, durations = data["traced"], data["durations"]
        # Skip the first steps: hooks are installed and caches warm on the first ones.
        start = min(50, len(durations) // 10) // 2 * 2
        diffs = _pair_diffs(durations, traced_flags, start)
        cpu_diffs = _pair_diffs(data["cpu"], traced_flags, start)
        untraced = [
            d for d, t in zip(durations[start:], traced_flags[start:], strict=True) if not t
        ]
        if i == 0:
            print(f"traceml: {data.get('traceml_file')}", flush=True)
        overheads.append(statistics.median(diffs) * 1e6)
        cpu_overheads.append(statistics.median(cpu_diffs) * 1e6)
        steps.append(_median_us(untraced))
        print(
            f"round {i + 1}: {len(diffs)} pairs, traced - untraced {overheads[-1]:.1f} us "
            f"(CPU time {cpu_overheads[-1]:.1f} us), untraced step {steps[-1]:.1f} us",
            flush=True,
        )
    return statistics.median(overheads), statistics.median(steps), statistics.median(cpu_overheads)


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
    args = parser.parse_args()
    if args.paired:
        with tempfile.TemporaryDirectory() as name:
            overhead_us, step_us, cpu_us = paired(args.rounds, args.seconds, Path(name))
        print(
            f"paired_overhead_us={overhead_us:.1f} step_us={step_us:.1f} "
            f"paired_overhead_cpu_us={cpu_us:.1f}"
        )
        return
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        plain, traced = overhead(args.rounds, args.seconds, tmp)
        print(f"median step: plain {plain:.1f} us, traced {traced:.1f} us")
        ratio = stalled_ratio(max(args.seconds, 6.0), tmp)
    print(f"overhead_us_per_step={traced - plain:.1f} stalled_aggregator_ratio={ratio:.3f}")


if __name__ == "__main__":
    main()
