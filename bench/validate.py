"""``traceml validate`` on a big, realistic step_time export, against parsing its lines.

On one file of ``--lines`` step_time lines of a ``--ranks``-rank run (64 unless told;
``bench.bigfile``: 8 phases a line, user phases among them, plus the closing line),
each reader runs in a subprocess of its own, so that its peak RSS is its own (``VmHWM``, the high-water
mark of the process's own memory since its ``exec``; ``ru_maxrss`` would start at
the parent's size, which it inherits at the fork):

* ``base``: ``validate_paths`` on a file of 1,000 such lines: the validator's memory
  that does not depend on the file (the interpreter, the schemas, the compiled
  checks, its read buffer);
* ``parse``: ``orjson.loads`` over every line (``for line in file``), the baseline;
* ``validate``: ``validate_paths`` on the file (it must find it valid).

    python -m bench.validate [--lines 1000000] [--ranks 64] [--keep FILE] [--pure]

``--keep`` writes the file there, or reuses it when it is already there (with as
many lines); ``--pure`` validates with ``TRACEML_PURE_PYTHON=1`` (no C extension).
Prints figures, never pass/fail. The last line is machine-readable:
``validate_vs_parse=<x> validate_rss_mb_per_million=<y>``: the parse time over the
validate time (above 1: validate reads faster than orjson parses), and validate's
peak RSS above the base process's, per million lines: what grows with the file.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bigfile import write_step_time


def _peak_rss_mb() -> float:
    """This process's peak resident memory since its exec."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import resource  # elsewhere: the peak since the fork, the parent's size included

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _child(mode: str, path: Path) -> None:
    """One reader, in its own process: prints the seconds it took and its peak RSS."""
    import orjson

    from traceml_records import validate_paths

    start = time.perf_counter()
    if mode == "parse":
        loads = orjson.loads
        with open(path, "rb") as fh:
            for line in fh:
                loads(line)
    elif mode in ("validate", "base"):
        report = validate_paths([path])
        assert report.ok, [str(p) for p in report.problems[:3]]
    print(f"{time.perf_counter() - start:.6f} {_peak_rss_mb():.1f}")


def _run(mode: str, path: Path, pure: bool = False) -> tuple[float, float]:
    """(seconds, peak RSS in MB) of one reader."""
    env = dict(os.environ)
    if pure:
        env["TRACEML_PURE_PYTHON"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "bench.validate", "--child", mode, str(path)],
        stdout=subprocess.PIPE,
        env=env,
        check=True,
    ).stdout
    seconds, rss = out.decode().split()[-2:]
    return float(seconds), float(rss)


def _lines_of(path: Path) -> int | None:
    """The written_records of the file's closing line, or None."""
    import orjson

    with open(path, "rb") as fh:
        fh.seek(max(0, path.stat().st_size - 4096))
        last = fh.read().rstrip(b"\n").rsplit(b"\n", 1)[-1]
    try:
        closing = orjson.loads(last)
    except orjson.JSONDecodeError:
        return None
    return closing.get("written_records") if isinstance(closing, dict) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--ranks", type=int, default=64, help="ranks of the run (a multiple of 8)")
    parser.add_argument("--keep", type=Path, default=None, help="write (or reuse) the file here")
    parser.add_argument("--pure", action="store_true", help="validate without the C extension")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "FILE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], Path(args.child[1]))
        return

    with tempfile.TemporaryDirectory() as tmp:
        path = args.keep or Path(tmp) / "step_time.jsonl"
        if path.exists() and _lines_of(path) == args.lines:
            print(f"reusing {path}")
        else:
            start = time.perf_counter()
            write_step_time(path, args.lines, world=args.ranks)
            print(f"wrote {args.lines:,} lines in {time.perf_counter() - start:.1f} s: {path}")
        size = path.stat().st_size
        print(
            f"file: {size / 1e6:,.0f} MB, {size / args.lines:.0f} bytes a line, {args.ranks:,} ranks"
        )
        small = Path(tmp) / "small" / "step_time.jsonl"
        small.parent.mkdir()
        write_step_time(small, 1000, world=args.ranks)
        _, base_rss = _run("base", small)
        with open(path, "rb") as fh:  # read once, so that both readers find it cached
            while fh.read(16 << 20):
                pass
        parse_s, parse_rss = _run("parse", path)
        validate_s, validate_rss = _run("validate", path, pure=args.pure)
    which = "validate_paths (pure Python)" if args.pure else "validate_paths"
    lines = args.lines
    for label, seconds, rss in (
        ("orjson.loads, every line", parse_s, parse_rss),
        (which, validate_s, validate_rss),
    ):
        print(
            f"{label:<30} {seconds:8.2f} s  {lines / seconds:>12,.0f} lines/s  "
            f"{size / seconds / 1e6:6.0f} MB/s  peak RSS {rss:6.0f} MB"
        )
    print(f"{'validate_paths, 1,000 lines':<30} {'':>51}peak RSS {base_rss:6.0f} MB")
    ratio = parse_s / validate_s
    per_million = (validate_rss - base_rss) / (lines / 1e6)
    print(f"validate_vs_parse={ratio:.2f} validate_rss_mb_per_million={per_million:.1f}")


if __name__ == "__main__":
    main()
