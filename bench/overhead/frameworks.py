"""TraceML's cost on the Hugging Face Trainer and Lightning paths, relative to untraced updates.

    python -m bench.overhead.frameworks [--rounds 5] [--hf-steps 300] [--lightning-steps 3000]

Each round runs two processes per framework, under ``traceml run --exporter jsonl
--export-streams all``, on the frameworks' tiny models (workloads/hf_trainer.py:
examples/hf_trainer.py's 2-layer GPT-2; workloads/lightning_fit.py:
examples/lightning_fit.py's MLP):

- traced: the zero-code attach on, one optimizer update in 4 traced and the 3 after it
  untraced inside the one ``train()``/``fit()`` (the bench's switch
  ``workloads/one_in_k.py``: hooks off from the end of a traced
  update to the end of the last untraced one);
- null: ``TRACEML_ZERO_CODE=0``, nothing of TraceML in the process, the updates placed
  in the same cycle by their index (the A/A run).

The scripts clock the start of every update from outside TraceML's wraps (HF:
``Trainer.get_batch_samples``, which fetches the update's batches; Lightning: the epoch
loop's ``advance``), so each interval is one whole update with its fetch, every
callback and TraceML's begin and end of it, in the training thread's CPU time
(``time.thread_time``) and wall time. Figures per round (``paired``):

- step: what a traced update costs over the last untraced one of its cycle (its own
  extra time and what spills into the updates after it), in % of that update: the
  same process, so the drift between runs cannot hide it; the null run's figure, the
  estimator's A/A, is printed beside it;
- step with threads: the step figure plus the CPU time TraceML's own threads used
  per traced update, read from their thread CPU clocks: the sender's (it builds,
  encodes and sends the items) over the traced updates, the sampler's (once per
  interval) over all of them. One process too, and an upper bound of what they take
  from training: they hold the interpreter's lock while they run, but torch's
  kernels release it and may run beside them on another core. With one update in 4
  traced, a flush's fixed work is charged to a quarter of the updates it would be in
  real use, so the figure is printed again with the threads' CPU per update of the run
  that traces every update (below);
- whole: what an update costs when every update is traced, against an update of the
  null run: the step figure plus what every update pays while TraceML is attached
  (the last untraced update over the null run's), in %; separate processes, so the
  noisier figure: the cost relative to an untraced ``train()``/``fit()``, as is the
  direct comparison below. Where the second null run's A/A is larger than 2 %, these
  figures cannot resolve the ≤ 2 % target, and the figures of one process decide
  (docs/benchmarks.md).

A third run per round traces every update (one in 1, as in real use): its
median update against the null run's, the same criterion measured directly (separate
processes again), and its mean wall update against the null run's mean. The mean is
the figure a user sees as a longer ``fit()``: it also counts what lands on a few
updates only, which every median skips: the sender's thread holding the interpreter
while it builds and encodes a flush, and collections of the garbage collector.

A fourth run per round is a second null run: its median update against the first null
run's is the A/A of the figures between processes (direct, whole), the size of what
the drift between two runs of the same script moves them by on this machine.

Each run is checked: one step_time line per traced update, and the
traced updates one in 4 (or all). Last line: ``hf_overhead_pct=<whole>
lightning_overhead_pct=<whole> hf_step_pct=<step> lightning_step_pct=<step>
hf_all_traced_pct=<x> lightning_all_traced_pct=<y> hf_all_traced_mean_wall_pct=<m>
lightning_all_traced_mean_wall_pct=<n> hf_step_with_threads_pct=<s>
lightning_step_with_threads_pct=<t> hf_null_vs_null_pct=<a>
lightning_null_vs_null_pct=<b> hf_step_with_threads_all_traced_pct=<u>
lightning_step_with_threads_all_traced_pct=<v>`` (medians over rounds; CPU time but for the mean wall
figures; the A/A as the median of its absolute values).
Figures only; no pass/fail.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.overhead.framework_runs import command, env
from bench.overhead.paired import Cycle, cycle, positions
from bench.overhead.workloads.update_clock import THREADS_FROM

# One update in ONE_IN traced (bench.overhead.paired).
ONE_IN = 4


def _step_time_lines(export: Path) -> int:
    path = export / "step_time.jsonl"
    if not path.is_file():
        return 0
    # Data lines only: the closing line has no "step".
    return sum(1 for line in path.read_bytes().splitlines() if b'"step":' in line)


def _launch(
    tmp: Path, framework: str, traced: bool, steps: int, name: str, one_in: int
) -> tuple[dict[str, Any], int]:
    """Run the script once: (its output, the step_time lines it exported)."""
    out = tmp / f"{name}.json"
    cmd = command(framework, tmp / "logs", name, out, steps, one_in)
    subprocess.run(
        cmd, env=env(traced), cwd=tmp, check=True, timeout=600,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    data: dict[str, Any] = orjson.loads(out.read_bytes())
    return data, _step_time_lines(tmp / "logs" / name / "aggregator" / "export")


def _check_lines(name: str, lines: int, expected: int) -> None:
    # The update in flight when the clock stopped is traced too, and has its line.
    if not expected - 1 <= lines <= expected:
        raise RuntimeError(f"{name}: {lines} step_time lines, expected {expected}")


def _mean_wall_us(data: dict[str, Any]) -> float:
    """The mean wall time of an update after the warm-up, µs: unlike the medians, it
    counts what lands on a few updates only (a garbage collection, the sender's
    thread holding the interpreter while it builds and encodes a flush)."""
    durations: list[float] = data["durations"]
    return statistics.fmean(durations[len(durations) // 10 :]) * 1e6


def _run(
    tmp: Path, framework: str, traced: bool, steps: int, name: str
) -> tuple[Cycle, Cycle, float, float]:
    """One run, one update in ONE_IN traced (``traced``) or none: (CPU µs, wall µs,
    mean wall µs, CPU µs of TraceML's threads per traced update)."""
    data, lines = _launch(tmp, framework, traced, steps, name, ONE_IN)
    flags: list[bool] = data["traced"]
    if traced:
        if flags[: 2 * ONE_IN] != ([True] + [False] * (ONE_IN - 1)) * 2:
            raise RuntimeError(f"{name}: the traced updates were not one in {ONE_IN}")
        _check_lines(name, lines, sum(flags) + (1 if len(flags) < steps else 0))
        where = positions(flags)
    else:
        if any(flags):
            raise RuntimeError(f"{name}: an update was traced with the attach off")
        _check_lines(name, lines, 0)
        where = [i % ONE_IN for i in range(len(flags))]
    skip = len(flags) // 10  # warm-up
    cpu = cycle([c * 1e6 for c in data["cpu"]], where, ONE_IN, skip)
    wall = cycle([d * 1e6 for d in data["durations"]], where, ONE_IN, skip)
    # The sender's work is the traced updates' items; the sampler's is per interval,
    # shared by every update.
    threads: dict[str, float] = data["threads_cpu"]
    counted = flags[THREADS_FROM:]
    sender = threads.get("traceml-sender", 0.0) / max(1, sum(counted))
    others = sum(v for k, v in threads.items() if k != "traceml-sender") / max(1, len(counted))
    return cpu, wall, _mean_wall_us(data), (sender + others) * 1e6


def _run_all_traced(tmp: Path, framework: str, steps: int, name: str) -> tuple[float, float, float]:
    """One run with every update traced: (the median update, CPU µs; the mean wall µs;
    the CPU µs TraceML's threads used per update)."""
    data, lines = _launch(tmp, framework, True, steps, name, 1)
    flags: list[bool] = data["traced"]
    if not all(flags):
        raise RuntimeError(f"{name}: an update was not traced")
    _check_lines(name, lines, steps)
    cpu: list[float] = data["cpu"]
    counted = max(1, len(flags) - THREADS_FROM)
    threads = sum(data["threads_cpu"].values()) / counted * 1e6
    return statistics.median(cpu[len(cpu) // 10 :]) * 1e6, _mean_wall_us(data), threads


def measure(
    framework: str, rounds: int, steps: int, tmp: Path
) -> tuple[float, float, float, float, float, float, float, float]:
    """Medians over rounds, in %: (whole, step, wall-clock step, all traced, all traced
    on the mean wall time, step with TraceML's threads, |null against null|, step with
    the threads of the every-update-traced run); CPU time but for the two wall
    figures."""
    whole: list[float] = []
    step: list[float] = []
    wall_step: list[float] = []
    direct: list[float] = []
    direct_mean: list[float] = []
    with_threads: list[float] = []
    null_vs_null: list[float] = []
    with_threads_all: list[float] = []
    for i in range(rounds):
        # Alternate which goes first, so a drift in machine load favours neither.
        order = (True, False) if i % 2 == 0 else (False, True)
        runs = {
            traced: _run(
                tmp, framework, traced, steps, f"{framework}{i}{'on' if traced else 'null'}"
            )
            for traced in order
        }
        all_traced, all_traced_mean, threads_all = _run_all_traced(
            tmp, framework, steps, f"{framework}{i}all"
        )
        second_null = _run(tmp, framework, False, steps, f"{framework}{i}null2")[0]
        (cpu, wall, _, threads), (null_cpu, _, null_mean, _) = runs[True], runs[False]
        last = cpu.by_position[-1]
        null_update = statistics.median(null_cpu.by_position)
        null_vs_null.append((statistics.median(second_null.by_position) / null_update - 1) * 100)
        step.append(cpu.cost / last * 100.0)
        with_threads.append((cpu.cost + threads) / last * 100.0)
        with_threads_all.append((cpu.cost + threads_all) / last * 100.0)
        wall_step.append(wall.cost / wall.by_position[-1] * 100.0)
        whole.append((cpu.cost + last - null_update) / null_update * 100.0)
        direct.append((all_traced / null_update - 1.0) * 100.0)
        direct_mean.append((all_traced_mean / null_mean - 1.0) * 100.0)
        print(
            f"{framework} round {i + 1}: CPU update {last:.1f} us (null run {null_update:.1f} "
            f"us); a traced update costs {cpu.cost:+.1f} us ({step[-1]:+.2f} %: own "
            f"{cpu.own:+.1f}, after it {cpu.spill:+.1f}; A/A {null_cpu.cost:+.1f} us), "
            f"{cpu.cost + threads:+.1f} us ({with_threads[-1]:+.2f} %) with the "
            f"{threads:.1f} us TraceML's threads used per traced update "
            f"({with_threads_all[-1]:+.2f} % with the {threads_all:.1f} us per update "
            f"they used when every update was traced); wall "
            f"{wall.cost:+.1f} us ({wall_step[-1]:+.2f} %); every update traced against "
            f"the null run: {cpu.cost + last - null_update:+.1f} us ({whole[-1]:+.2f} %); "
            f"a run with every update traced: {all_traced:.1f} us ({direct[-1]:+.2f} %), "
            f"mean wall {all_traced_mean:.1f} us against {null_mean:.1f} us "
            f"({direct_mean[-1]:+.2f} %); a second null run against the first: "
            f"{null_vs_null[-1]:+.2f} %",
            flush=True,
        )
    return (
        statistics.median(whole),
        statistics.median(step),
        statistics.median(wall_step),
        statistics.median(direct),
        statistics.median(direct_mean),
        statistics.median(with_threads),
        statistics.median(abs(x) for x in null_vs_null),
        statistics.median(with_threads_all),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--hf-steps", type=int, default=300, help="updates per HF run")
    parser.add_argument(
        "--lightning-steps", type=int, default=3000, help="updates per Lightning run"
    )
    parser.add_argument("--only", choices=("hf", "lightning"), help="one framework only")
    args = parser.parse_args()
    nan = float("nan")
    hf = lightning = (nan, nan, nan, nan, nan, nan, nan, nan)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        if args.only != "lightning":
            hf = measure("hf", args.rounds, args.hf_steps, tmp)
        if args.only != "hf":
            lightning = measure("lightning", args.rounds, args.lightning_steps, tmp)
    print(
        f"wall-clock step figures (noisier on a shared machine): hf {hf[2]:+.2f} %, "
        f"lightning {lightning[2]:+.2f} %"
    )
    print(
        f"hf_overhead_pct={hf[0]:.2f} lightning_overhead_pct={lightning[0]:.2f} "
        f"hf_step_pct={hf[1]:.2f} lightning_step_pct={lightning[1]:.2f} "
        f"hf_all_traced_pct={hf[3]:.2f} lightning_all_traced_pct={lightning[3]:.2f} "
        f"hf_all_traced_mean_wall_pct={hf[4]:.2f} "
        f"lightning_all_traced_mean_wall_pct={lightning[4]:.2f} "
        f"hf_step_with_threads_pct={hf[5]:.2f} lightning_step_with_threads_pct={lightning[5]:.2f} "
        f"hf_null_vs_null_pct={hf[6]:.2f} lightning_null_vs_null_pct={lightning[6]:.2f} "
        f"hf_step_with_threads_all_traced_pct={hf[7]:.2f} "
        f"lightning_step_with_threads_all_traced_pct={lightning[7]:.2f}"
    )


if __name__ == "__main__":
    main()
