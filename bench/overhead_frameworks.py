"""TraceML's cost on the Hugging Face Trainer and Lightning paths, relative to untraced runs.

    python bench/overhead_frameworks.py [--rounds 5] [--hf-steps 300] [--lightning-steps 3000]

Each framework's tiny model (bench/_overhead_hf_train.py: examples/hf_trainer.py's
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

Last line: ``hf_overhead_pct=<x> lightning_overhead_pct=<y>``. Figures only; no
pass/fail.
"""

from __future__ import annotations

import argparse
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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        hf, hf_wall = measure("hf", args.rounds, args.hf_steps, tmp)
        lightning, lightning_wall = measure("lightning", args.rounds, args.lightning_steps, tmp)
    print(
        f"wall-clock figures (noisier on a shared machine): hf {hf_wall:+.2f} %, "
        f"lightning {lightning_wall:+.2f} %"
    )
    print(f"hf_overhead_pct={hf:.2f} lightning_overhead_pct={lightning:.2f}")


if __name__ == "__main__":
    main()
