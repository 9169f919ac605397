"""``summarize_run`` on one big step_time file (what ``traceml summary`` reads).

Writes ``--lines`` step_time lines (8 ranks, 5 phases each, the real encoder; see
``bench/frames.py``) plus the closing line into a run folder, then times
``summarize_run`` on it, best of ``--repeat``.

    .venv/bin/python bench/summary.py [--lines 1000000] [--keep FOLDER] [--repeat 1]

Prints figures, never pass/fail; the last line is machine-readable:
``summarize_run_s=<t> lines_per_s=<z>``.
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from pathlib import Path

from bench.frames import write_file
from traceml_ai.run_summary import summarize_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, default=None, help="run folder to write (or reuse)")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run = args.keep or Path(tmp) / "run"
        path = run / "aggregator" / "export" / "step_time.jsonl"
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            write_file(path, args.lines)
        size = path.stat().st_size
        best = float("inf")
        for _ in range(args.repeat):
            gc.collect()
            t0 = time.perf_counter()
            summary = summarize_run(run)
            best = min(best, time.perf_counter() - t0)
        steps = sum(s.steps for s in (summary.step_time or {}).values())
        print(f"file: {size / 2**20:.0f} MiB, {steps} steps over {len(summary.ranks)} ranks")
        print(f"files: {summary.loss.status}")
        print(f"summarize_run_s={best:.2f} lines_per_s={steps / best:.0f}")


if __name__ == "__main__":
    main()
