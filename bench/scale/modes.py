"""The long modes: --find-max, --soak, --overload."""

from __future__ import annotations

import argparse
import gc
import itertools
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import orjson

from ..export import raw_once
from .aggregator import Sample
from .items import LoadSpec
from .run import RunResult, final_line, report, run_once

# -- modes --------------------------------------------------------------------------------


RAW_SAMPLE_RECORDS = 50_000
"""Records of the best probe's files the raw baseline serializes (in the files' mix)."""


def raw_records_per_s(run_dir: Path, rounds: int = 3) -> float:
    """The raw baseline on a run's own records: records/s of ``bench.export``'s raw path
    (prebuilt dicts -> ``orjson.dumps`` -> a buffered write) over a sample of the lines
    the run wrote, each stream in its share of the files; the best of ``rounds``."""
    export = run_dir / "aggregator" / "export"
    counts = {
        path: max(0, path.read_bytes().count(b"\n") - 1)  # less the closing line
        for path in sorted(export.glob("*.jsonl"))
    }
    total = sum(counts.values())
    if total == 0:
        return 0.0
    dicts: list[dict[str, Any]] = []
    for path, count in counts.items():
        take = math.ceil(count * min(1.0, RAW_SAMPLE_RECORDS / total))
        with open(path, "rb") as f:
            dicts.extend(orjson.loads(line) for line in itertools.islice(f, take))
    best = math.inf
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            gc.collect()
            best = min(best, raw_once(dicts, Path(tmp)))
    return len(dicts) / best


def find_max(args: argparse.Namespace, base: LoadSpec, logs_dir: Path) -> None:
    """Double the steps/s while every batch arrives, then bisect; each probe a fresh run.

    The best probe's files stay until the search ends: the raw baseline is measured on
    their records, after the probes, in the same process."""
    best: RunResult | None = None
    best_dir: Path | None = None
    lo, hi = 0.0, None
    steps = base.steps_per_s
    for probe in range(args.probes):
        if hi is not None:
            steps = (lo + hi) / 2
        spec = _replace(base, steps_per_s=round(steps, 1), seconds=args.probe_seconds)
        name = f"probe{probe}"
        r = run_once(
            spec,
            args.streams,
            logs_dir=logs_dir,
            run_name=name,
            procs=args.procs,
            bounds=args.bounds,
            do_validate=False,
            quiet=True,
        )
        verdict = "sustained" if r.sustained else "NOT sustained"
        print(
            f"probe {probe}: {spec.steps_per_s:g} steps/s -> offered {r.offered_records_per_s:,.0f}"
            f" written {r.records_per_s:,.0f} records/s, dropped {r.dropped:,}, "
            f"agg {r.agg_cpu_cores:.2f} cores ({r.cpu_s_per_1k:.3f} CPU s/1k), gen "
            f"{r.gen_cpu_cores:.2f} cores lag {r.gen_max_lag_s * 1000:.0f} ms, "
            f"queue hw {r.queue_hw_batches:,} / {r.queue_hw_bytes / 2**20:.1f} MiB, "
            f"drain {r.drain_s:.1f} s, peak RSS {r.peak_rss_mb:.0f} MB, "
            f"accounting {'exact' if r.check.exact else 'NOT EXACT'}: {verdict}",
            flush=True,
        )
        keep = False
        if r.sustained:
            lo = spec.steps_per_s
            if best is None or r.records_per_s > best.records_per_s:
                best = r
                if best_dir is not None and not args.keep:
                    shutil.rmtree(best_dir, ignore_errors=True)
                best_dir, keep = logs_dir / name, True
            if hi is None:
                steps = spec.steps_per_s * 2
        else:
            hi = spec.steps_per_s
            if r.gen_max_lag_s >= 0.5 and r.dropped == 0:
                print(
                    "  (the generator fell behind its schedule: this probe measured the generator)"
                )
        if not keep and not args.keep:
            shutil.rmtree(logs_dir / name, ignore_errors=True)
        if hi is not None and lo and hi - lo <= max(1.0, lo * 0.05):
            break
    if best is None or best_dir is None:
        print("no probe was sustained")
        sys.exit(1)
    print("best sustained probe:")
    report(best)
    raw = raw_records_per_s(best_dir)
    if not args.keep:
        shutil.rmtree(best_dir, ignore_errors=True)
    ratio = best.records_per_s / raw if raw else 0.0
    print(
        f"raw baseline on the best probe's records (prebuilt dicts -> orjson -> buffered write, "
        f"one core): {raw:,.0f} records/s; max sustained / raw = {ratio:.3f}"
    )
    print(f"{final_line(best, best.records_per_s)} find_max_vs_raw={ratio:.3f}")


def soak(args: argparse.Namespace, spec: LoadSpec, logs_dir: Path) -> None:
    r = run_once(
        spec,
        args.streams,
        logs_dir=logs_dir,
        run_name="soak",
        procs=args.procs,
        bounds=args.bounds,
        do_validate=not args.no_validate,
        sample_interval_s=1.0,
    )
    warm = [s for s in r.samples if s.t - r.t0 >= args.warmup]
    loaded = [s for s in warm if s.t - r.t0 <= spec.seconds]
    if not loaded:
        print("soak: no samples after warm-up")
        sys.exit(1)
    ref = loaded[0]
    rss = [s.rss for s in loaded]
    fds = {s.fds for s in loaded}
    threads = {s.threads for s in loaded}
    drift = (max(rss) - ref.rss) / ref.rss
    print(
        f"soak: {len(loaded)} samples after {args.warmup:g} s warm-up: RSS {ref.rss / 2**20:.0f} MB "
        f"at warm-up end, min {min(rss) / 2**20:.0f} / max {max(rss) / 2**20:.0f} MB "
        f"(drift {drift * 100:+.1f}%: {'flat' if abs(drift) <= 0.10 else 'NOT flat'}), "
        f"fds {sorted(fds)}, threads {sorted(threads)} "
        f"({'no growth' if len(fds) == 1 and len(threads) == 1 else 'CHANGED'})"
    )
    minutes: dict[int, Sample] = {}
    for s in loaded:
        minutes.setdefault(int((s.t - r.t0) // 60), s)
    print(
        "soak: RSS by minute (MB): "
        + " ".join(f"{m}:{s.rss / 2**20:.0f}" for m, s in sorted(minutes.items()))
    )
    print(final_line(r, r.records_per_s if r.sustained else 0))


def overload(args: argparse.Namespace, spec: LoadSpec, logs_dir: Path) -> None:
    r = run_once(
        spec,
        args.streams,
        logs_dir=logs_dir,
        run_name="overload",
        procs=args.procs,
        bounds=args.bounds,
        do_validate=not args.no_validate,
    )
    bound = r.max_queue_bytes
    growth = r.peak_rss_mb - r.idle_rss_mb
    limit = 1.2 * bound / 2**20
    print(
        f"overload: peak RSS {r.peak_rss_mb:.0f} MB = idle {r.idle_rss_mb:.0f} MB + "
        f"{growth:.0f} MB; queue bound {bound / 2**20:.0f} MiB (+20% = {limit:.0f} MB): "
        f"{'within' if growth <= limit else 'NOT within'}; growth / queue high water bytes = "
        f"{growth * 2**20 / max(r.queue_hw_bytes, 1):.2f}; generator never blocked "
        f"(non-blocking sockets; longest flush {r.gen_max_flush_ms:.1f} ms, "
        f"{r.sender_dropped_batches:,} batches dropped at the generator)"
    )
    print(final_line(r, 0))


def _replace(spec: LoadSpec, **changes: Any) -> LoadSpec:
    return LoadSpec(**{**spec.__dict__, **changes})
