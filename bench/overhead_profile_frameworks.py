"""TraceML's share of a Lightning or Hugging Face update, sampled (needs py-spy).

    python bench/overhead_profile_frameworks.py [--only lightning|hf] [--steps N] [--rate HZ]

Runs the framework's tiny model (bench/_overhead_lightning_train.py,
bench/_overhead_hf_train.py) under ``traceml run --exporter jsonl --export-streams
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
import collections
import linecache
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path

HERE = Path(__file__).resolve().parent
SRC = HERE.parent / "src"
SCRIPTS = {
    "lightning": HERE / "_overhead_lightning_train.py",
    "hf": HERE / "_overhead_hf_train.py",
}
# A frame of the training loop: samples under it are the updates'.
LOOP_FRAMES = {
    "lightning": "advance (lightning/pytorch/loops/training_epoch_loop.py",
    "hf": "_inner_training_loop (transformers/trainer.py",
}
# Source text of a frame that only passes the call on (its callees are not TraceML's):
# a wrapper calling what it wraps (``original(...)``, ``original_to(...)``), a gate's
# forwarding call.
PASS_ON = re.compile(r"\boriginal\w*\(|\bgate_call\(|PyObject_Vectorcall\(fn")
# The deepest Python frame of a thread waiting for work, and the native frames of one
# blocked (on the interpreter's lock, most often: those samples are not work either).
WAITING = ("Condition.wait (threading.py", "Event.wait (threading.py")
BLOCKED = ("pthread_cond_timedwait ", "pthread_cond_wait ", "pthread_cond_clockwait ", "sem_")
_TRACEML_FRAME = re.compile(r"\((traceml_ai/[^:]+):(\d+)\)")


def passes_on(frame: str, src: Path = SRC) -> bool:
    """Whether ``frame`` (py-spy's ``function (path:line)``) only calls into the framework.

    A C frame's line is its return address's, the statement after the call, so the
    three lines before it are read too."""
    match = _TRACEML_FRAME.search(frame)
    if match is None:
        return False
    path, line = match.group(1), int(match.group(2))
    lines = range(line - 3, line + 1) if path.endswith(".c") else [line]
    text = "".join(linecache.getline(str(src / path), i) for i in lines)
    return PASS_ON.search(text) is not None


def _is_traceml(frame: str) -> bool:
    return "traceml_ai/" in frame and "traceml_ai/_bootstrap.py" not in frame


def shares(
    raw: Iterable[str], loop_frame: str, src: Path = SRC
) -> tuple[int, int, int, collections.Counter[str]]:
    """From py-spy's raw lines (``frame;frame;... count``): (the training loop's samples,
    TraceML's own among them, TraceML's threads' working samples, TraceML's own by
    function)."""
    loop = own = threads = 0
    by_function: collections.Counter[str] = collections.Counter()
    for line in raw:
        stack, _, count_text = line.rstrip("\n").rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = stack.split(";")
        thread_at = next((i for i, f in enumerate(frames) if f.startswith("thread (")), None)
        if thread_at is None or not any("_bootstrap" in f for f in frames[:thread_at]):
            continue  # not the rank's process
        thread = frames[thread_at].split(": ", 1)[-1]
        below = frames[thread_at + 1 :]
        if thread.startswith("traceml-"):
            python = [f for f in below if ".py:" in f]
            waiting = python and python[-1].startswith(WAITING)
            if not waiting and not any(f.startswith(BLOCKED) for f in below):
                threads += count
            continue
        if thread != "MainThread":
            continue
        at = next((i for i, f in enumerate(below) if loop_frame in f), None)
        if at is None:
            continue
        loop += count
        ours = [f for f in below[at + 1 :] if _is_traceml(f)]
        if ours and not passes_on(ours[-1], src):
            own += count
            by_function[ours[-1].split(" (")[0]] += count
    return loop, own, threads, by_function


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
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEML_")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    env["TRACEML_ZERO_CODE"] = "1"
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        raw = tmp / "samples.txt"
        cmd = [
            spy, "record", "--native", "--threads", "--subprocesses", "-r", str(args.rate),
            "-f", "raw", "-o", str(raw), "--",
            sys.executable, "-m", "traceml_ai", "run", "--logs-dir", str(tmp / "logs"),
            "--run-name", "profile", "--exporter", "jsonl", "--export-streams", "all",
            str(SCRIPTS[args.only]), str(tmp / "clock.json"), str(args.steps), "1",
        ]  # fmt: skip
        subprocess.run(
            cmd, env=env, cwd=tmp, check=True, timeout=1800,
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
