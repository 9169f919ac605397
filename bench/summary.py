"""``traceml summary`` and the dashboard on a big step_time export, against parsing it.

Writes a realistic export of ``--lines`` step_time lines (``bench.bigfile``:
``--ranks`` ranks, 64 unless told, 6 built-in and 2 user phases, ~1.4 kB a line) and
measures, each in a process of its own (CPU seconds and peak RSS from the process
itself, so a busy machine moves the ratios little):

With ``--collectives``, the run also has a collectives file: one line per step line
(``bench.bigfile``: DDP's all-reduce in backward, the wait measured), which the summary
joins to the steps (the follow figures stay those of step_time alone).

With ``--process N``, the run also has the sampler files (``bench.bigfile``'s
``write_process``): N process lines (one per rank every 2 s), and the system and
system_gpu lines of as many snapshots (one per node, one per GPU); the summary reads
them too (the follow figures stay those of step_time alone).

* ``parse``: reading the file in blocks and ``orjson.loads`` on every line, nothing
  else: the floor any reader of JSON lines pays;
* ``summary``: ``summarize_run`` on the run folder (what ``traceml summary`` prints:
  every value checked, the figures, the straggler analysis);
* ``follow``: the dashboard from files (``FilesSource``, whose ``RunReader`` is what
  ``traceml summary --follow`` keeps) on a run still being written (the same lines, no
  closing line), through the server's own ``Views``: its first view (the page's first
  request, ``?charts=0``: the reader, the page data and the page's JSON, figures and
  tables without the lines over steps), the second request (the same data, the lines
  over steps added), then ``--append`` more lines written and one refresh (the reader,
  the page data and the page's JSON).

    python -m bench.summary [--lines 1000000] [--ranks 64] [--append 640] [--keep FOLDER]
        [--no-follow] [--collectives] [--process N]

Prints figures, never pass/fail; the last line is machine-readable:
``summary_vs_parse=<x> summary_rss_mb_per_million=<m> follow_refresh_s=<t>
first_view_vs_summary=<v>``: parse CPU time over the summary's (above 1: faster than
parsing), the summary's peak RSS beyond an idle interpreter's per million lines, the
dashboard's refresh after the append (CPU seconds: on an idle machine its wall time,
as the process waits for nothing; on a busy one the wall time, printed too, is the
machine's), and its first view's CPU time over the summary's. The second request's
CPU time (the charts, after the first paint) is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bigfile import write_process, write_step_time

_EXPORT = Path("aggregator") / "export" / "step_time.jsonl"
_COLLECTIVES = _EXPORT.with_name("collectives.jsonl")


def _usage() -> dict[str, float]:
    me = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": me.ru_utime + me.ru_stime, "rss_mb": me.ru_maxrss / 1024}


def _child_parse(path: Path) -> dict[str, Any]:
    import orjson

    loads = orjson.loads
    start = _usage()["cpu_s"]
    pending = b""
    lines = 0
    with open(path, "rb") as fh:
        while block := fh.read(16 << 20):
            complete = (pending + block).split(b"\n")
            pending = complete.pop()
            for raw in complete:
                loads(raw)
            lines += len(complete)
    return {"cpu_s": _usage()["cpu_s"] - start, "lines": lines}


def _child_summary(run: Path) -> dict[str, Any]:
    from traceml_ai.analysis import summarize_run

    start = _usage()["cpu_s"]
    t0 = time.perf_counter()
    summary = summarize_run(run)
    wall = time.perf_counter() - t0
    steps = sum(s.steps for s in (summary.step_time or {}).values())
    return {
        "cpu_s": _usage()["cpu_s"] - start,
        "wall_s": wall,
        "steps": steps,
        "status": summary.loss.status,
        "verdict": summary.straggler.line() if summary.straggler else None,
    }


def _child_idle() -> dict[str, Any]:
    import numpy  # noqa: F401  (what the summary imports)

    import traceml_ai.analysis  # noqa: F401

    return {}


def _child_follow(run: Path, more: Path) -> dict[str, Any]:
    """The dashboard from files on a run being written, as the page asks for it: its
    first view (``?charts=0``) and the second request (the charts), both the server's
    ``Views`` answers; then, after ``more`` is appended, one refresh (the reader's, the
    page data's and the page's JSON). The file is cut back to its size afterwards, so
    ``--keep`` can reuse it."""
    import orjson

    from traceml_ai.dashboard._files import FilesSource
    from traceml_ai.dashboard._server import Views
    from traceml_ai.dashboard._view import build_view

    path = run / _EXPORT
    size = path.stat().st_size
    source = FilesSource(run)
    views = Views(source, final=lambda: False)
    cpu0, t0 = _usage()["cpu_s"], time.perf_counter()
    first_body = views.json(charts=False)
    first = {"cpu_s": _usage()["cpu_s"] - cpu0, "wall_s": time.perf_counter() - t0}
    cpu0, t0 = _usage()["cpu_s"], time.perf_counter()
    charts_body = views.json()
    charts = {"cpu_s": _usage()["cpu_s"] - cpu0, "wall_s": time.perf_counter() - t0}
    first_view, charts_view = orjson.loads(first_body), orjson.loads(charts_body)
    # The first view is the page without its lines over steps, the second fills them.
    assert first_view["step_time"].get("deferred") and not first_view["step_time"]["steps"]
    assert charts_view["step_time"]["steps"] and charts_view["ranks"] == first_view["ranks"]
    reader = source._reader
    assert reader is not None
    before = sum(s.steps for s in (reader.summary().step_time or {}).values())
    try:
        with open(path, "ab") as fh:
            fh.write(more.read_bytes())
        source._at = 0.0  # the next look is due now
        cpu0, t0 = _usage()["cpu_s"], time.perf_counter()
        data = source()
        build_view(data)
        refresh = {"cpu_s": _usage()["cpu_s"] - cpu0, "wall_s": time.perf_counter() - t0}
    finally:
        os.truncate(path, size)
    return {
        "view_first_cpu_s": first["cpu_s"],
        "view_first_s": first["wall_s"],
        "view_first_bytes": len(first_body),
        "view_charts_cpu_s": charts["cpu_s"],
        "view_charts_s": charts["wall_s"],
        "view_charts_bytes": len(charts_body),
        "view_refresh_cpu_s": refresh["cpu_s"],
        "view_refresh_s": refresh["wall_s"],
        "steps_before": before,
        "view_steps_after": sum(data.total_steps.values()),
    }


def _child(kind: str, args: list[str]) -> None:
    paths = [Path(a) for a in args]
    if kind == "parse":
        out = _child_parse(paths[0])
    elif kind == "summary":
        out = _child_summary(paths[0])
    elif kind == "follow":
        out = _child_follow(paths[0], paths[1])
    else:
        out = _child_idle()
    out.update({f"self_{k}": v for k, v in _usage().items()})
    print(json.dumps(out))


def _run(kind: str, *paths: Path) -> dict[str, Any]:
    env = dict(os.environ)
    res = subprocess.run(
        [sys.executable, "-m", "bench.summary", "--child", kind, *map(str, paths)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if res.returncode != 0:
        raise SystemExit(f"bench.summary: the {kind} child failed:\n{res.stderr}")
    out: dict[str, Any] = json.loads(res.stdout.strip().splitlines()[-1])
    return out


def _prepare(
    folder: Path,
    lines: int,
    append: int,
    grow: bool,
    ranks: int,
    collectives: bool,
    process: int = 0,
) -> tuple[Path, Path, Path]:
    """(whole run, growing run, the lines to append), written unless already there."""
    whole = folder / ("whole-collectives" if collectives else "whole")
    if process:
        whole = whole.with_name(f"{whole.name}-process-{process}")
        if not (whole / _EXPORT.with_name("process.jsonl")).exists():
            (whole / _EXPORT).parent.mkdir(parents=True, exist_ok=True)
            t0 = time.perf_counter()
            counts = write_process((whole / _EXPORT).parent, process, world=ranks)
            shown = ", ".join(f"{n:,} {name}" for name, n in counts.items())
            print(f"wrote {shown} lines in {time.perf_counter() - t0:.1f} s", flush=True)
    growing = folder / "growing"
    more = folder / "more.jsonl"
    if not (whole / _EXPORT).exists():
        (whole / _EXPORT).parent.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        write_step_time(
            whole / _EXPORT,
            lines,
            world=ranks,
            collectives=whole / _COLLECTIVES if collectives else None,
        )
        print(f"wrote {lines:,} lines in {time.perf_counter() - t0:.1f} s", flush=True)
    if grow and not (growing / _EXPORT).exists():
        (growing / _EXPORT).parent.mkdir(parents=True, exist_ok=True)
        longer = folder / "longer.jsonl"
        write_step_time(longer, lines + append, world=ranks)
        with open(longer, "rb") as src, open(growing / _EXPORT, "wb") as dst:
            left = lines
            rest = b""
            while block := src.read(16 << 20):
                count = block.count(b"\n")
                if count < left:
                    dst.write(block)
                    left -= count
                    continue
                cut = 0
                for _ in range(left):
                    cut = block.index(b"\n", cut) + 1
                dst.write(block[:cut])
                rest = block[cut:] + src.read()
                break
        # The appended lines: the rest, without its closing line.
        more.write_bytes(rest.rstrip(b"\n").rsplit(b"\n", 1)[0] + b"\n")
        longer.unlink()
    return whole, growing, more


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3:])
        return
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--lines", type=int, default=1_000_000)
    ap.add_argument("--ranks", type=int, default=64, help="ranks of the run (a multiple of 8)")
    ap.add_argument("--append", type=int, default=640, help="lines appended for the follow figures")
    ap.add_argument("--keep", type=Path, default=None, help="folder to write (or reuse)")
    ap.add_argument(
        "--no-follow",
        action="store_true",
        help="skip the follow figures (and the second copy of the file they need)",
    )
    ap.add_argument(
        "--collectives",
        action="store_true",
        help="the run has a collectives file too (one line per step line)",
    )
    ap.add_argument(
        "--process",
        type=int,
        default=0,
        metavar="N",
        help="the run has N process lines too, and their system and system_gpu lines",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        whole, growing, more = _prepare(
            folder,
            args.lines,
            args.append,
            not args.no_follow,
            args.ranks,
            args.collectives,
            args.process,
        )
        size = (whole / _EXPORT).stat().st_size
        print(f"file: {size / 1e6:,.0f} MB, {args.lines:,} step_time lines ({args.ranks:,} ranks)")
        if args.collectives:
            size = (whole / _COLLECTIVES).stat().st_size
            print(f"file: {size / 1e6:,.0f} MB, {args.lines:,} collectives lines")
        for name in ("process", "system", "system_gpu") if args.process else ():
            size = (whole / _EXPORT.with_name(f"{name}.jsonl")).stat().st_size
            print(f"file: {size / 1e6:,.0f} MB of {name} lines")
        idle = _run("idle")
        parse = _run("parse", whole / _EXPORT)
        summary = _run("summary", whole)
        follow = None if args.no_follow else _run("follow", growing, more)
    ratio = parse["cpu_s"] / summary["cpu_s"]
    rss = summary["self_rss_mb"] - idle["self_rss_mb"]
    per_million = rss / (args.lines / 1e6)
    print(f"parse (orjson.loads, every line)  {parse['cpu_s']:8.2f} CPU s")
    print(
        f"summarize_run                     {summary['cpu_s']:8.2f} CPU s "
        f"({summary['wall_s']:.2f} s wall), peak RSS {summary['self_rss_mb']:.0f} MB "
        f"({idle['self_rss_mb']:.0f} MB idle)"
    )
    print(f"  {summary['steps']:,} steps; files: {summary['status']}; {summary['verdict']}")
    line = f"summary_vs_parse={ratio:.2f} summary_rss_mb_per_million={per_million:.0f}"
    if follow is not None:
        print(
            f"dashboard from files: first view (?charts=0, {follow['view_first_bytes']:,} "
            f"B) {follow['view_first_cpu_s']:.2f} CPU s ({follow['view_first_s']:.2f} s "
            f"wall); the charts (second request, {follow['view_charts_bytes']:,} B) "
            f"{follow['view_charts_cpu_s']:.3f} CPU s; after {args.append} more lines one "
            f"refresh {follow['view_refresh_cpu_s']:.3f} CPU s ({follow['view_refresh_s']:.3f} "
            f"s wall), {follow['steps_before']:,} -> {follow['view_steps_after']:,} steps"
        )
        line += (
            f" follow_refresh_s={follow['view_refresh_cpu_s']:.3f} "
            f"first_view_vs_summary={follow['view_first_cpu_s'] / summary['cpu_s']:.2f}"
        )
    print(line)


if __name__ == "__main__":
    main()
