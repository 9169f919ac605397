"""Profiling the aggregator with py-spy."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from .aggregator import AggregatorProc


def py_spy(out: Path, seconds: float) -> Callable[[AggregatorProc, float], None]:
    """A ``during`` hook: sample the aggregator with py-spy for the load's duration."""
    exe = _py_spy_exe()

    def start(agg: AggregatorProc, t0: float) -> None:
        cmd = [exe, "record", "--pid", str(agg.pid), "--format", "raw", "--rate", "200"]
        cmd += [
            "--gil",
            "--nonblocking",
            "--duration",
            str(max(1, int(seconds))),
            "--output",
            str(out),
        ]
        threading.Thread(
            target=subprocess.run,
            args=(cmd,),
            kwargs={"capture_output": True, "timeout": seconds + 120},
            daemon=True,
        ).start()

    return start


def _py_spy_exe() -> str:
    """py-spy beside the interpreter (installed in its environment), else on PATH."""
    beside = Path(sys.executable).with_name("py-spy")
    if beside.exists():
        return str(beside)
    found = shutil.which("py-spy")
    if found is None:
        raise SystemExit("bench.scale: --py-spy needs py-spy (pip install py-spy)")
    return found


def summarize_profile(path: Path, top: int = 15) -> None:
    """Top functions of a py-spy ``raw`` (collapsed stacks) profile: self and total %."""
    deadline = time.monotonic() + 60
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.5)
    time.sleep(1.0)  # py-spy writes the file when the target exits
    print_profile(path, top)


def print_profile(path: Path, top: int = 15) -> None:
    """Print the summary of a py-spy ``raw`` profile (also ``python -m bench.scale --summarize FILE``)."""
    selfs: dict[str, int] = {}
    totals: dict[str, int] = {}
    threads: dict[str, int] = {}
    n = 0
    for line in path.read_text().splitlines():
        stack, _, count_s = line.rpartition(" ")
        if not stack:
            continue
        count = int(count_s)
        # One entry per function: "name (file:line)" -> "name (file)".
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]
        n += count
        threads[frames[0]] = threads.get(frames[0], 0) + count
        leaf = frames[-1]
        selfs[leaf] = selfs.get(leaf, 0) + count
        for f in set(frames[1:]):
            totals[f] = totals.get(f, 0) + count
    if not n:
        print("profile: no samples")
        return
    print(f"profile: {n:,} samples ({path})")
    for name, count in sorted(threads.items(), key=lambda kv: -kv[1])[:4]:
        print(f"  thread {count / n * 100:5.1f}%  {name}")
    print("  top self:")
    for name, count in sorted(selfs.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {count / n * 100:5.1f}%  {name}")
    print("  top total:")
    for name, count in sorted(totals.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {count / n * 100:5.1f}%  {name}")
