"""TraceML's share of a Lightning or Hugging Face update, sampled (needs py-spy).

    python -m bench.overhead.sampled [--only lightning|hf] [--steps N] [--rate HZ]

Runs the framework's tiny model (workloads/lightning_fit.py,
workloads/hf_trainer.py) under ``traceml run --exporter jsonl --export-streams
all``, every update traced, inside ``py-spy record --native --threads --subprocesses``,
and reads the samples of the rank's training thread taken inside the training loop
(Lightning: the epoch loop's ``advance``; HF: ``Trainer._inner_training_loop``):

- TraceML's share: the samples whose deepest TraceML frame (Python or C) is TraceML's
  own work, not a frame that only passes the call on to the framework or torch (the
  batch wrapper's ``original(...)``, a gate's forwarding call: told by their source
  line), in % of the loop's samples, with its split by function;
- the threads' share: samples of TraceML's threads that are neither waiting for work
  nor blocked (on the interpreter's lock, mostly), in % of the same, an upper bound of
  what they take from training (a thread in a system call runs beside training on
  another core).

A ratio of samples within one run: the drift between runs that makes the timed
figures between processes swing by several % here does not move it. What it does not
see: work TraceML causes in frames not its own (torch's loop over hooks, collections
of the garbage collector). Last line: ``<framework>_traceml_share_pct=<x>
<framework>_threads_share_pct=<y>``. Figures only.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.overhead.framework_runs import SCRIPTS, command, env
from bench.overhead.profile_share import LOOP_FRAMES, shares


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=sorted(SCRIPTS), default="lightning")
    parser.add_argument("--steps", type=int, default=4000, help="updates (HF: use ~300)")
    parser.add_argument("--rate", type=int, default=400, help="samples per second")
    parser.add_argument("--top", type=int, default=8, help="functions listed")
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        sys.exit("py-spy is needed: pip install py-spy")
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        raw = tmp / "samples.txt"
        spied = [
            spy, "record", "--native", "--threads", "--subprocesses", "-r", str(args.rate),
            "-f", "raw", "-o", str(raw), "--",
        ]  # fmt: skip
        run = command(args.only, tmp / "logs", "profile", tmp / "clock.json", args.steps, 1)
        subprocess.run(
            spied + run, env=env(traced=True), cwd=tmp, check=True, timeout=1800,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        with raw.open() as lines:
            loop, own, threads, by_function = shares(lines, LOOP_FRAMES[args.only])
    if loop == 0:
        sys.exit("no sample of the training loop: was the run too short?")
    own_pct, threads_pct = own / loop * 100, threads / loop * 100
    print(f"{args.only}: {loop} samples of the training loop; TraceML's own {own_pct:.2f} %")
    for function, count in by_function.most_common(args.top):
        print(f"  {count:6d}  {function}")
    print(f"TraceML's threads working: {threads_pct:.2f} % of the loop's samples")
    print(
        f"{args.only}_traceml_share_pct={own_pct:.2f} {args.only}_threads_share_pct={threads_pct:.2f}"
    )


if __name__ == "__main__":
    main()
