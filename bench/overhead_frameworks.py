"""TraceML's cost on the Hugging Face Trainer and Lightning paths, relative to untraced updates.

    python bench/overhead_frameworks.py [--rounds 5] [--hf-steps 300] [--lightning-steps 3000]

Paired (the default), so that the drift between processes cannot hide the cost: one
process per framework and round, under ``traceml run --exporter jsonl --export-streams
all`` with the zero-code attach on, in which traced and untraced optimizer updates
alternate inside the one ``train()``/``fit()`` (the benchmark switch
``traceml_ai.integrations._common.ALTERNATE``: TraceML's hooks are off from the end of
a traced update to the end of the next one). The scripts clock the start of every
update from outside TraceML's wraps (HF: ``Trainer.get_batch_samples``, which fetches
the update's batches; Lightning: the epoch loop's ``advance``), so each interval is one
whole update with its fetch, every callback and TraceML's begin and end of it. Per
round: the median of (traced update - the next untraced update), as a % of the median
untraced update (the first 10 % of the pairs skipped: warm-up), in the training
thread's CPU time (``time.thread_time``) and wall time; the figure is the median over
rounds, CPU time. Each run is checked: one step_time line per traced update, and the
updates alternated. What an untraced update pays too (TraceML's hooks returning at
once, the forward hook that puts torch's ``_call_impl`` on its slow path, the wraps
passing through) is left out by construction; the separate-process form brackets it.

    python bench/overhead_frameworks.py --separate [...]

Separate processes, as before the paired form: each framework's tiny model (bench/_overhead_hf_train.py: examples/hf_trainer.py's
2-layer GPT-2; bench/_overhead_lightning_train.py: examples/lightning_fit.py's MLP)
runs under ``traceml run --exporter jsonl --export-streams all`` with the zero-code
attach off (``TRACEML_ZERO_CODE=0``: nothing of TraceML in the process) and on,
interleaved in the same session, ``--rounds`` times each with the order alternating,
so machine noise hits both alike. The scripts time their own optimizer updates with
a callback of their own, in the training thread's CPU time (``time.thread_time``: on
a shared machine, wall time mostly measures the other processes) and wall time. Per
round: median update time of each run (the first 10 % skipped: warm-up), and
traced / untraced - 1; the figure is the median over rounds, CPU time (the wall-clock
figure is printed above it).
Each run is checked: the traced one exported one step_time line per update, the
untraced one none.

Last line (either form): ``hf_overhead_pct=<x> lightning_overhead_pct=<y>``. Figures
only; no pass/fail.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import orjson

HERE = Path(__file__).resolve().parent
SCRIPTS = {
    "hf": HERE / "_overhead_hf_train.py",
    "lightning": HERE / "_overhead_lightning_train.py",
}


def _env(traced: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env["OMP_NUM_THREADS"] = "1"
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_OFFLINE"] = "1"
    env["TRACEML_ZERO_CODE"] = "1" if traced else "0"
    return env


def _step_time_lines(export: Path) -> int:
    path = export / "step_time.jsonl"
    if not path.is_file():
        return 0
    # Data lines only: the closing line has no "step".
    return sum(1 for line in path.read_bytes().splitlines() if b'"step":' in line)


def _median_us(values: list[float]) -> float:
    # The first 10 % are warm-up.
    return statistics.median(values[len(values) // 10 :]) * 1e6


def _run(tmp: Path, framework: str, traced: bool, steps: int, name: str) -> tuple[float, float]:
    """(median update µs of the training thread's CPU time, median wall µs) of one run."""
    out = tmp / f"{name}.json"
    cmd = [
        sys.executable, "-m", "traceml_ai", "run",
        "--logs-dir", str(tmp / "logs"), "--run-name", name,
        "--exporter", "jsonl", "--export-streams", "all",
        str(SCRIPTS[framework]), str(out), str(steps),
    ]  # fmt: skip
    subprocess.run(
        cmd, env=_env(traced), cwd=tmp, check=True, timeout=600,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    lines = _step_time_lines(tmp / "logs" / name / "aggregator" / "export")
    expected = steps if traced else 0
    if lines != expected:
        raise RuntimeError(f"{name}: {lines} step_time lines, expected {expected}")
    data = orjson.loads(out.read_bytes())
    return _median_us(data["cpu"]), _median_us(data["durations"])


def _run_paired(tmp: Path, framework: str, steps: int, name: str) -> dict[str, float]:
    """One paired run: medians of the untraced update and of (traced - next untraced)."""
    out = tmp / f"{name}.json"
    cmd = [
        sys.executable, "-m", "traceml_ai", "run",
        "--logs-dir", str(tmp / "logs"), "--run-name", name,
        "--exporter", "jsonl", "--export-streams", "all",
        str(SCRIPTS[framework]), str(out), str(steps), "paired",
    ]  # fmt: skip
    subprocess.run(
        cmd, env=_env(True), cwd=tmp, check=True, timeout=600,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    data = orjson.loads(out.read_bytes())
    traced: list[bool] = data["traced"]
    if traced[:4] != [True, False, True, False] or any(
        a == b for a, b in itertools.pairwise(traced)
    ):
        raise RuntimeError(f"{name}: traced and untraced updates did not alternate")
    lines = _step_time_lines(tmp / "logs" / name / "aggregator" / "export")
    expected = (steps + 1) // 2
    if lines != expected:
        raise RuntimeError(f"{name}: {lines} step_time lines, expected {expected}")
    result: dict[str, float] = {}
    for clock in ("cpu", "durations"):
        times: list[float] = data[clock]
        pairs = [i for i in range(0, len(times) - 1, 2) if traced[i]]
        skip = len(pairs) // 10  # warm-up
        diffs = [times[i] - times[i + 1] for i in pairs[skip:]]
        untraced = [times[i + 1] for i in pairs[skip:]]
        result[f"{clock}_untraced_us"] = statistics.median(untraced) * 1e6
        result[f"{clock}_diff_us"] = statistics.median(diffs) * 1e6
    return result


def measure_paired(framework: str, rounds: int, steps: int, tmp: Path) -> tuple[float, float]:
    """Median over rounds of the paired overhead in % of the untraced update: (CPU, wall)."""
    cpu_pcts: list[float] = []
    wall_pcts: list[float] = []
    for i in range(rounds):
        r = _run_paired(tmp, framework, steps, f"{framework}{i}paired")
        cpu_pcts.append(r["cpu_diff_us"] / r["cpu_untraced_us"] * 100.0)
        wall_pcts.append(r["durations_diff_us"] / r["durations_untraced_us"] * 100.0)
        print(
            f"{framework} paired round {i + 1}: CPU untraced update {r['cpu_untraced_us']:.1f} us, "
            f"traced - untraced {r['cpu_diff_us']:+.1f} us ({cpu_pcts[-1]:+.2f} %); wall "
            f"{r['durations_untraced_us']:.1f} us, {r['durations_diff_us']:+.1f} us "
            f"({wall_pcts[-1]:+.2f} %)",
            flush=True,
        )
    return statistics.median(cpu_pcts), statistics.median(wall_pcts)


def measure(framework: str, rounds: int, steps: int, tmp: Path) -> tuple[float, float]:
    """Median over rounds of (traced / untraced median update - 1) in %: (CPU, wall)."""
    cpu_pcts: list[float] = []
    wall_pcts: list[float] = []
    for i in range(rounds):
        # Alternate which goes first, so a drift in machine load favours neither.
        order = (False, True) if i % 2 == 0 else (True, False)
        medians: dict[bool, tuple[float, float]] = {}
        for traced in order:
            name = f"{framework}{i}{'on' if traced else 'off'}"
            medians[traced] = _run(tmp, framework, traced, steps, name)
        (cpu_off, wall_off), (cpu_on, wall_on) = medians[False], medians[True]
        cpu_pcts.append((cpu_on / cpu_off - 1.0) * 100.0)
        wall_pcts.append((wall_on / wall_off - 1.0) * 100.0)
        print(
            f"{framework} round {i + 1}: CPU per update untraced {cpu_off:.1f} us, traced "
            f"{cpu_on:.1f} us ({cpu_pcts[-1]:+.2f} %); wall {wall_off:.1f} / {wall_on:.1f} us "
            f"({wall_pcts[-1]:+.2f} %)",
            flush=True,
        )
    return statistics.median(cpu_pcts), statistics.median(wall_pcts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hf-steps", type=int, default=300, help="updates per HF run")
    parser.add_argument(
        "--lightning-steps", type=int, default=3000, help="updates per Lightning run"
    )
    parser.add_argument(
        "--separate", action="store_true", help="traced and untraced runs in separate processes"
    )
    parser.add_argument("--only", choices=("hf", "lightning"), help="one framework only")
    args = parser.parse_args()
    run = measure if args.separate else measure_paired
    hf = hf_wall = lightning = lightning_wall = float("nan")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if args.only != "lightning":
            hf, hf_wall = run("hf", args.rounds, args.hf_steps, tmp)
        if args.only != "hf":
            lightning, lightning_wall = run("lightning", args.rounds, args.lightning_steps, tmp)
    print(
        f"wall-clock figures (noisier on a shared machine): hf {hf_wall:+.2f} %, "
        f"lightning {lightning_wall:+.2f} %"
    )
    print(f"hf_overhead_pct={hf:.2f} lightning_overhead_pct={lightning:.2f}")


if __name__ == "__main__":
    main()
