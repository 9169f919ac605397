"""The export-file readers of two source trees, alternating in one run: is reading
slower than in an earlier tree?

Both trees read the same files, each reader in a process of its own whose
``PYTHONPATH`` is that tree's ``src`` (with its own C extensions, built in place:
``python setup.py build_ext --inplace`` in that tree), in the order old, new, old,
new... for ``--rounds`` rounds; each reader's best round counts, in CPU seconds of its
process (user + system: on a shared machine wall time moves with the load, CPU time
much less). The readers:

* ``validate``: ``traceml_records.validate_paths`` on a step_time file of ``--lines``
  lines of a 64-rank run (``bench.bigfile``, as ``bench.validate`` reads);
* ``summary``: ``traceml_ai.analysis.summarize_run`` on a run folder holding it;
* ``frames``: ``traceml_records.frames.load`` on it (the typed table and its phases);
* ``follow``: a ``RunReader`` on a run folder of ``--follow-lines`` lines without
  its closing line, its first summary, then ``--append`` more lines appended and one
  more summary: the CPU seconds of that refresh alone.

    python -m bench.trees --old /tmp/base43/src [--new src] [--lines 1000000]
        [--rounds 3] [--keep FOLDER] [--only validate,summary]

Prints each reader's best CPU seconds per tree and ``old / new`` (above 1: the new
tree reads faster). The last line is machine-readable: ``validate_old_over_new=<x>
summary_old_over_new=<y> ...``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bigfile import write_step_time

READERS = ("validate", "summary", "frames", "follow")
_EXPORT = Path("aggregator") / "export" / "step_time.jsonl"


def _cpu() -> float:
    return time.process_time()


def _child(reader: str, path: Path, more: Path | None) -> None:
    """One reader in this process; prints its CPU seconds (and the module it ran)."""
    if reader == "validate":
        from traceml_records import validate_paths

        start = _cpu()
        report = validate_paths([path])
        spent = _cpu() - start
        if not report.ok:
            raise SystemExit(f"bench.trees: {path} is not valid: {report.problems[:3]}")
        where = validate_paths.__module__
    elif reader == "summary":
        from traceml_ai.analysis import summarize_run

        start = _cpu()
        summary = summarize_run(path)
        spent = _cpu() - start
        where = summarize_run.__module__
        if summary.problems:
            raise SystemExit(f"bench.trees: problems in {path}: {summary.problems[:3]}")
    elif reader == "frames":
        from traceml_records import frames

        start = _cpu()
        loaded = frames.load(path)
        spent = _cpu() - start
        where = frames.__name__
        del loaded
    else:
        from traceml_ai.analysis import RunReader

        assert more is not None
        reader_ = RunReader(path)
        reader_.summary()
        with open(path / _EXPORT, "ab") as fh:
            fh.write(more.read_bytes())
        start = _cpu()
        reader_.summary()
        spent = _cpu() - start
        where = RunReader.__module__
    module = sys.modules[where.split(".")[0]]
    print(json.dumps({"cpu_s": spent, "from": str(Path(module.__file__ or "").parent.parent)}))


def _run(src: Path, reader: str, path: Path, more: Path | None) -> float:
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{Path.cwd()}")
    env.pop("TRACEML_PURE_PYTHON", None)
    args = [sys.executable, "-m", "bench.trees", "--child", reader, str(path)]
    if more is not None:
        args += ["--more", str(more)]
    res = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"bench.trees: {reader} of {src} failed:\n{res.stderr[-3000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if Path(out["from"]).resolve() != src.resolve():
        raise SystemExit(f"bench.trees: {reader} ran {out['from']}, not {src}")
    return float(out["cpu_s"])


def _prepare(folder: Path, lines: int, follow_lines: int, append: int) -> tuple[Path, Path, Path]:
    """(the run folder of ``lines`` lines, the follow file without its closing line,
    the lines appended to it), written unless already there."""
    run = folder / f"run_{lines}"
    if not (run / _EXPORT).exists():
        (run / _EXPORT).parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_step_time(run / _EXPORT, lines)
        print(f"wrote {lines:,} lines in {time.perf_counter() - t0:.1f} s", flush=True)
    growing = folder / f"follow_{follow_lines}.jsonl"
    more = folder / f"more_{follow_lines}_{append}.jsonl"
    if not growing.exists() or not more.exists():
        longer = folder / "longer.jsonl"
        write_step_time(longer, follow_lines + append)
        body = longer.read_bytes().splitlines(keepends=True)[:-1]  # no closing line
        growing.write_bytes(b"".join(body[:follow_lines]))
        more.write_bytes(b"".join(body[follow_lines:]))
        longer.unlink()
    return run, growing, more


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", type=Path, help="the earlier tree's src folder")
    ap.add_argument("--new", type=Path, default=Path("src"), help="this tree's src folder")
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--follow-lines", type=int, default=100_000)
    ap.add_argument("--append", type=int, default=640)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=",".join(READERS), help="readers, comma-separated")
    ap.add_argument("--keep", type=Path, default=None, help="folder to write (or reuse)")
    ap.add_argument("--child", nargs=2, metavar=("READER", "PATH"), help=argparse.SUPPRESS)
    ap.add_argument("--more", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        _child(args.child[0], Path(args.child[1]), args.more)
        return
    if args.old is None:
        ap.error("--old is required")
    readers = [r for r in args.only.split(",") if r]
    unknown = set(readers) - set(READERS)
    if unknown:
        ap.error(f"unknown readers: {', '.join(sorted(unknown))}")
    folder = args.keep or Path(tempfile.mkdtemp(prefix="bench_trees_"))
    folder.mkdir(parents=True, exist_ok=True)
    run, growing, more = _prepare(folder, args.lines, args.follow_lines, args.append)
    size = (run / _EXPORT).stat().st_size
    print(f"file: {size / 1e6:,.0f} MB, {args.lines:,} step_time lines (64 ranks)")
    trees = {"old": args.old, "new": args.new}
    best: dict[tuple[str, str], float] = {}
    for round_ in range(args.rounds):
        for reader in readers:
            for name, src in trees.items():
                more_arg: Path | None = None
                if reader == "follow":
                    target = folder / "follow_run"
                    shutil.rmtree(target, ignore_errors=True)
                    (target / _EXPORT).parent.mkdir(parents=True)
                    shutil.copyfile(growing, target / _EXPORT)
                    more_arg = more
                elif reader == "frames":
                    target = run / _EXPORT
                else:
                    target = run if reader == "summary" else run / _EXPORT
                spent = _run(src, reader, target, more_arg)
                key = (reader, name)
                best[key] = min(best.get(key, spent), spent)
                print(f"round {round_ + 1} {reader:<9} {name:<4} {spent:8.3f} CPU s", flush=True)
    print()
    print(f"{'reader':<10} {'old CPU s':>10} {'new CPU s':>10} {'old / new':>10}")
    ratios = []
    for reader in readers:
        old, new = best[(reader, "old")], best[(reader, "new")]
        print(f"{reader:<10} {old:10.3f} {new:10.3f} {old / new:10.2f}")
        ratios.append(f"{reader}_old_over_new={old / new:.2f}")
    if args.keep is None:
        shutil.rmtree(folder, ignore_errors=True)
    print(" ".join(ratios))


if __name__ == "__main__":
    main()
