"""Count the Python lines TraceML adds to a Lightning or Hugging Face update.

Lines executed per update on the training thread, every update traced and attached
but untraced, against the same updates without TraceML.

    python -m bench.overhead.lines [--only lightning] [--top 12]

On the tiny models of ``frameworks`` a Lightning update is ~4,600 lines
of Lightning's and torch's Python, and what TraceML adds on the training thread is
mostly Python too (its C calls are ~11 an update): the count is what to cut, and it
does not move with the machine's load, which the timed figures do (±30 % between
processes on a shared 2-core VM). Each mode runs the framework's bench script
(workloads/lightning_fit.py, workloads/hf_trainer.py) under ``traceml run
--exporter jsonl --export-streams all``; its update clock (workloads/update_clock.py,
``LINE_WINDOW``) counts with ``sys.settrace`` the lines and calls the training thread
runs in a window of updates after the warm-up:

- null: ``TRACEML_ZERO_CODE=0``, nothing of TraceML in the process;
- traced: the zero-code attach on, every update traced (as in real use);
- idle: attached, one update traced and every later one not (the benchmark switch
  ``workloads/one_in_k.py``): what an update pays while TraceML is attached without tracing.

A line is not a unit of time (an attribute lookup and a tensor op are one line each),
so this shows where TraceML's Python is and whether a change cut it; the timed
figures stay ``frameworks``'.

Last line: ``<framework>_traced_lines=<extra lines per update>
<framework>_idle_lines=<...>`` per framework. Figures only.
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import tempfile
from pathlib import Path

import orjson

from bench.overhead.framework_runs import SCRIPTS, command, env
from bench.overhead.workloads.update_clock import LINE_WINDOW

WINDOW = {"lightning": (300, 400), "hf": (30, 40)}
ONE_IN = {"null": 1, "traced": 1, "idle": 10**9}

Key = tuple[str, str, int]


def count_lines(framework: str, mode: str, tmp: Path) -> collections.Counter[Key]:
    """Lines and calls per function in the window of one run."""
    first, last = WINDOW[framework]
    out = tmp / f"{framework}-{mode}"
    out.mkdir()
    counts_path = out / "lines.json"
    cmd = command(framework, out / "logs", "r", out / "out.json", last + 10, ONE_IN[mode])
    run_env = env(traced=mode != "null")
    run_env[LINE_WINDOW] = f"{first},{last},{counts_path}"
    subprocess.run(
        cmd, env=run_env, cwd=out, check=True,
        timeout=900, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    rows = orjson.loads(counts_path.read_bytes())
    return collections.Counter({(f, name, line): n for f, name, line, n in rows})


def _short(key: Key) -> str:
    path, name, line = key
    for marker in ("site-packages/", "/src/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    return f"{path}:{line} {name}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=tuple(SCRIPTS), help="one framework only")
    parser.add_argument("--top", type=int, default=12, help="functions listed per mode")
    args = parser.parse_args()
    figures: list[str] = []
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        for framework in (args.only,) if args.only else tuple(SCRIPTS):
            first, last = WINDOW[framework]
            updates = last - first
            counts = {mode: count_lines(framework, mode, tmp) for mode in ONE_IN}
            null = counts["null"]
            null_total = sum(null.values()) / updates
            print(f"{framework}: {null_total:,.0f} lines an update without TraceML")
            for mode in ("traced", "idle"):
                extra = counts[mode].copy()
                extra.subtract(null)
                added = sum(extra.values()) / updates
                print(f"  {mode}: {added:+.1f} lines an update ({added / null_total:+.2%})")
                for key, n in sorted(extra.items(), key=lambda kv: -abs(kv[1]))[: args.top]:
                    if n:
                        print(f"    {n / updates:+7.1f}  {_short(key)}")
                figures.append(f"{framework}_{mode}_lines={added:.1f}")
    print(" ".join(figures))


if __name__ == "__main__":
    main()
