"""Loading one step_time file as typed tables, side by side with the usual readers.

On the same file of ``--lines`` step_time lines of a 64-rank run (``bench.bigfile``:
the real encoder's bytes, 8 phases a line, user phases among them, plus the closing
line), in this order:

* ``traceml_records.frames.load``: the typed ``step_time`` table and the flattened
  ``step_time_phases`` table (both built; closing line left out);
* ``pyarrow.json.read_json``, untyped (nested structs, nothing flattened);
* ``pandas.read_json(lines=True)`` (``events`` stays a column of Python dicts).

    python -m bench.frames [--lines 1000000] [--keep FILE] [--rounds 2] [--no-pandas]

``--keep`` writes the file there, or reuses it. The file is read once first (so that
every reader finds it cached), then ours and pyarrow's alternate for ``--rounds``
rounds and each one's best counts (pandas runs once). Prints figures, never pass/fail. The
last line is machine-readable: ``frames_vs_pandas=<x> frames_vs_pyarrow_json=<y>
lines_per_s=<z>`` where a ratio is the other reader's time over ours (above 1: ours
is faster; ``frames_vs_pandas=nan`` with ``--no-pandas``).
"""

from __future__ import annotations

import argparse
import gc
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.bigfile import USER_PHASES, write_step_time

PHASES = 6 + len(USER_PHASES)
"""Phases a line of the file has: the built-in ones and the user phases."""


def _timed(label: str, fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    elapsed = time.perf_counter() - start
    print(f"{label:<34} {elapsed:8.2f} s")
    del result
    gc.collect()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--keep", type=Path, default=None, help="write (or reuse) the file here")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of ours and pyarrow's")
    parser.add_argument("--no-pandas", action="store_true", help="leave pandas out (slow)")
    args = parser.parse_args()

    import pandas as pd
    import pyarrow.json as pajson

    from traceml_records import frames

    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "step_time.jsonl"
        if not path.exists():
            start = time.perf_counter()
            write_step_time(path, args.lines)
            print(f"wrote {args.lines} lines in {time.perf_counter() - start:.1f} s: {path}")
        size = path.stat().st_size
        print(f"file: {size / 1e6:.0f} MB, {args.lines} data lines + closing line")

        def ours() -> Any:
            loaded = frames.load(path)
            assert loaded.tables["step_time"].num_rows == args.lines
            assert loaded.tables["step_time_phases"].num_rows == PHASES * args.lines
            return loaded

        path.read_bytes()
        t_ours = t_arrow = float("inf")
        for _ in range(args.rounds):
            t_ours = min(t_ours, _timed("frames.load (typed + phases)", ours))
            untyped = _timed("pyarrow.json.read_json (untyped)", lambda: pajson.read_json(path))
            t_arrow = min(t_arrow, untyped)
        t_pandas = float("nan")
        if not args.no_pandas:
            t_pandas = _timed(
                "pandas.read_json(lines=True)", lambda: pd.read_json(path, lines=True)
            )
    vs_pandas = t_pandas / t_ours
    vs_arrow = t_arrow / t_ours
    print(
        f"frames_vs_pandas={vs_pandas:.2f} frames_vs_pyarrow_json={vs_arrow:.2f} "
        f"lines_per_s={args.lines / t_ours:.0f}"
    )


if __name__ == "__main__":
    main()
