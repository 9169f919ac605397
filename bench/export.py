"""Export engine figures: end-to-end throughput, submit latency, stalled memory.

Prints figures only; never passes or fails. The last line is machine-readable:

    export_ratio_vs_raw=<x> submit_p99_us=<y> stalled_peak_over_bound=<z>

- end to end: wire batches of ``--stream`` (step_time; process; or mix: every batch
  stream in turn) as the server queues them (still encoded) →
  ``ExportPipeline.submit`` → RecordBuilder (line mode) → JsonlExporter → lines on
  disk (``finalize`` included, so the closing lines too), next to a raw baseline in
  the same run: the same lines (record mode's) as prebuilt dicts → ``orjson.dumps`` →
  a buffered file write. Export and raw alternate for ``--rounds`` rounds and the best
  round of each counts. Measured first with CPython's default GC thresholds, then with
  the setting every aggregator process runs with (``tune_gc_for_aggregator``); the
  machine-readable ratio is the latter, the aggregator as deployed.
- submit latency: ``submit()`` p50/p99/max while the worker is saturated (a backlog
  is always queued, so the worker thread competes for the GIL the whole time).
- stalled memory: the exporter blocks in ``export``; 10x the queue's byte bound of
  freshly decoded batches is submitted; the peak of traced Python memory above the
  start is compared with the byte bound (which counts wire bytes, not objects).

    python -m bench.export [--records 200000] [--batch 100] [--stream step_time]

With ``--baseline PATH`` (another checkout, e.g. a ``git worktree`` of the commit
before) only the end-to-end figure is taken, with the aggregator's GC setting: this
tree's ``src`` and the baseline's, each in its own process running this bench, taking
turns ``--rounds`` times; last line ``export_records_per_s=<this tree, median>
baseline_records_per_s=<median> export_vs_baseline=<ratio>``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from traceml_ai.aggregator import tune_gc_for_aggregator
from traceml_ai.export import ExportSummary, ExportWorker, RecordBuilder, start_export
from traceml_ai.settings import ExportSettings
from traceml_ai.testing import make_batch_body, make_identity, make_item, make_phase
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import dumps_line
from traceml_records.internal import BATCH_STREAMS

IDENTITY = make_identity(0, world_size=2, local_world_size=2, pid=1234)
PHASES = ("dataloader_next", "forward_time", "backward_time", "optimizer_step", "step_time")
STREAM_CHOICES = ("step_time", "process", "mix")
"""``--stream``: one batch stream, or mix: the batches cycle through every batch stream."""


def step_time_item(seq: int) -> dict[str, Any]:
    """A CPU step as the rank SDK sends it: five built-in phases."""
    events = {
        f"_traceml_internal:{name}": {"cpu": make_phase(1.0 + k + seq % 7 / 8)}
        for k, name in enumerate(PHASES)
    }
    return make_item("step_time", seq, events=events)


def item(stream: str, seq: int) -> dict[str, Any]:
    """One item of batch stream ``stream`` as the rank SDK sends it."""
    if stream == "step_time":
        return step_time_item(seq)
    if stream == "process":
        return make_item("process", seq, device="cuda:0" if seq % 2 else "cpu")
    return make_item(stream, seq, identity=IDENTITY)


def batch_streams(choice: str) -> tuple[str, ...]:
    return BATCH_STREAMS if choice == "mix" else (choice,)


def export_settings(choice: str) -> ExportSettings:
    """The JSONL export of what ``choice`` sends (mix: every stream)."""
    return ExportSettings(exporter="jsonl", export_streams="all" if choice == "mix" else choice)


def frame(first_seq: int, n: int, stream: str = "step_time") -> bytes:
    """One batch message body, as a rank sends it."""
    items = [item(stream, seq) for seq in range(first_seq, first_seq + n)]
    return make_batch_body(stream, items, IDENTITY)


def frames(choice: str, records: int, per_batch: int) -> list[bytes]:
    """The bodies of ``records`` items of ``choice``, ``per_batch`` to a batch."""
    streams = batch_streams(choice)
    return [
        frame(first, per_batch, streams[n % len(streams)])
        for n, first in enumerate(range(0, records, per_batch))
    ]


def received(body: bytes) -> ReceivedBatch:
    """A batch as the aggregator's server queues it: the frame body, still encoded (a
    fresh copy each time, as each frame arrives in its own buffer)."""
    return ReceivedBatch(time.time_ns(), bytes(bytearray(body)), len(body))


def _record_lines(batches: list[ReceivedBatch], streams: tuple[str, ...]) -> list[bytes]:
    """The lines of ``batches`` as record mode writes them."""
    builder = RecordBuilder(streams, include_hostname=False)
    return [
        dumps_line(record)
        for b in batches
        for group in builder.build(b).records.values()
        for record in group
    ]


def _raw_dicts(lines: list[bytes]) -> list[dict[str, Any]]:
    """The lines as prebuilt dicts (what the raw baseline serializes)."""
    return [orjson.loads(line) for line in lines]


def _export_once(bodies: list[bytes], total: int, settings: ExportSettings, tmp: Path) -> float:
    """Seconds from the first submit to finalize() returning, all lines on disk."""
    batches = [received(b) for b in bodies]
    run_dir = tmp / f"run-{time.monotonic_ns()}"
    streams = settings.export_streams.selected
    begin = time.perf_counter()
    pipeline = start_export(
        settings, run_dir, max_queue_batches=len(batches) + 1, max_queue_bytes=2**40
    )
    assert pipeline is not None and pipeline.failure is None
    for b in batches:
        pipeline.submit(b)
    stats = pipeline.finalize(timeout=600.0)
    took = time.perf_counter() - begin
    export_dir = run_dir / "aggregator" / "export"
    lines = sum((export_dir / f"{s}.jsonl").read_bytes().count(b"\n") for s in streams)
    written = sum(stats.written_records.values())
    assert written == total and lines == total + len(streams), (stats, lines)
    shutil.rmtree(run_dir)
    return took


def raw_once(dumps: list[dict[str, Any]], tmp: Path) -> float:
    """Seconds to serialize ``dumps`` with orjson and write them, buffered."""
    raw_path = tmp / "raw.jsonl"
    option = orjson.OPT_APPEND_NEWLINE
    begin = time.perf_counter()
    with open(raw_path, "wb") as f:
        write = f.write
        for d in dumps:
            write(orjson.dumps(d, option=option))
    took = time.perf_counter() - begin
    raw_path.unlink()
    return took


def bench_end_to_end(
    records: int, per_batch: int, rounds: int, choice: str = "step_time"
) -> tuple[float, float, float, list[float]]:
    """(export records/s, raw records/s, build-only records/s, per-round ratios).

    Export and raw alternate for ``rounds`` rounds; each rate is the best round's
    (the least disturbed by whatever else the machine did), and the per-round
    ratios show the spread. Records: the lines written (a system item's GPUs too).
    """
    bodies = frames(choice, records, per_batch)
    batches = [received(b) for b in bodies]
    settings = export_settings(choice)
    streams = settings.export_streams.selected
    lines = _record_lines(batches, streams)
    total = len(lines)

    # Build only: the aggregator-side cost before any file write (record mode).
    builder = RecordBuilder(streams, include_hostname=False)
    begin = time.perf_counter()
    built = sum(builder.build(b).record_count for b in batches)
    build_rate = built / (time.perf_counter() - begin)

    export_s: list[float] = []
    raw_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            gc.collect()
            export_s.append(_export_once(bodies, total, settings, Path(tmp)))
            # Built per round and dropped after: 200,000 live dicts would otherwise
            # sit in the GC's way during the next export round.
            dumps = _raw_dicts(lines)
            gc.collect()
            raw_s.append(raw_once(dumps, Path(tmp)))
            del dumps
    ratios = [r / e for e, r in zip(export_s, raw_s, strict=True)]
    return total / min(export_s), total / min(raw_s), build_rate, ratios


def _run_tree(tree: Path, args: argparse.Namespace) -> float:
    """End-to-end records/s of one round with ``tree``'s ``src`` (this bench's code)."""
    here = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree / "src"), str(here)])}
    command = [sys.executable, "-m", "bench.export", "--one", "--rounds", "1"]
    command += ["--records", str(args.records), "--batch", str(args.batch)]
    command += ["--stream", args.stream]
    out = subprocess.run(command, env=env, cwd=here, check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.splitlines()[-1]))


def compare_trees(args: argparse.Namespace) -> None:
    """This tree against ``args.baseline``, alternating processes, ``args.rounds`` times."""
    here = Path(__file__).resolve().parent.parent
    runs: dict[str, list[float]] = {"this": [], "baseline": []}
    for _ in range(args.rounds):
        runs["this"].append(_run_tree(here, args))
        runs["baseline"].append(_run_tree(args.baseline.resolve(), args))
        print(" ".join(f"{name}={v[-1]:,.0f}" for name, v in runs.items()), flush=True)
    mine, base = statistics.median(runs["this"]), statistics.median(runs["baseline"])
    print(
        f"export_records_per_s={mine:.0f} baseline_records_per_s={base:.0f}"
        f" export_vs_baseline={mine / base:.3f}"
    )


class _Stalled:
    """An exporter stuck in ``export`` until released."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def export(self, records: Sequence[Any]) -> None:
        self.release.wait()

    def close(self, summary: ExportSummary) -> None:
        return None


def bench_submit_latency(per_batch: int, seconds: float) -> tuple[float, float, float, int, int]:
    """(p50 µs, p99 µs, max µs, submits, dropped) of submit() with a saturated worker."""
    bodies = [frame(i * per_batch, per_batch) for i in range(64)]
    with tempfile.TemporaryDirectory() as tmp:
        pipeline = start_export(
            ExportSettings(exporter="jsonl"), Path(tmp), max_queue_batches=2_000
        )
        assert pipeline is not None
        # Prefill a backlog so the worker never waits during the measurement.
        for i in range(1_000):
            pipeline.submit(received(bodies[i % 64]))
        samples: list[int] = []
        clock = time.perf_counter_ns
        end = time.monotonic() + seconds
        i = 0
        while time.monotonic() < end:
            b = received(bodies[i % 64])  # the receive loop decodes, then submits
            t0 = clock()
            pipeline.submit(b)
            samples.append(clock() - t0)
            i += 1
        queued = pipeline.worker.queued_batches
        stats = pipeline.finalize(timeout=0.0)
    samples.sort()
    assert queued > 0, "the worker was not saturated"
    p50 = samples[len(samples) // 2] / 1000
    p99 = samples[int(len(samples) * 0.99)] / 1000
    return p50, p99, samples[-1] / 1000, len(samples), stats.dropped_batches


def bench_stalled_memory(per_batch: int, bound_bytes: int) -> tuple[float, int, int]:
    """(peak traced bytes above start / bound, batches submitted, batches dropped)."""
    bodies = [frame(i * per_batch, per_batch) for i in range(16)]
    exporter = _Stalled()
    worker = ExportWorker(
        exporter,
        RecordBuilder(("step_time",), include_hostname=False),
        max_queue_batches=10**9,  # the byte bound is the one under test
        max_queue_bytes=bound_bytes,
    )
    worker.start()
    gc.collect()
    tracemalloc.start()
    base, _ = tracemalloc.get_traced_memory()
    tracemalloc.reset_peak()
    submitted_bytes = 0
    n = 0
    while submitted_bytes < 10 * bound_bytes:
        b = received(bodies[n % 16])
        submitted_bytes += b.nbytes
        worker.submit(b)
        n += 1
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    dropped = worker.stats().dropped_batches
    exporter.release.set()
    worker.shutdown(timeout=0.0)
    return (peak - base) / bound_bytes, n, dropped


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch", type=int, default=100, help="items per wire batch")
    parser.add_argument("--rounds", type=int, default=3, help="export/raw rounds, best kept")
    parser.add_argument("--latency-seconds", type=float, default=2.0)
    parser.add_argument("--bound-mib", type=int, default=16, help="queue byte bound, stalled run")
    parser.add_argument("--stream", choices=STREAM_CHOICES, default="step_time")
    parser.add_argument("--baseline", type=Path, default=None, help="another checkout")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.baseline is not None:
        compare_trees(args)
        return
    if args.one:
        tune_gc_for_aggregator()
        rate, _, _, _ = bench_end_to_end(args.records, args.batch, args.rounds, args.stream)
        print(json.dumps(rate))
        return

    # First with CPython's default GC thresholds, then as an aggregator process runs.
    default_export, default_raw, build_rate, default_ratios = bench_end_to_end(
        args.records, args.batch, args.rounds, args.stream
    )
    print(f"build only (RecordBuilder record mode, {args.stream}): {build_rate:,.0f} records/s")
    print(
        f"default GC: end to end {default_export:,.0f} records/s, raw {default_raw:,.0f}"
        f" records/s: {default_export / default_raw:.3f} (per round: "
        + ", ".join(f"{r:.3f}" for r in default_ratios)
        + ")"
    )
    tune_gc_for_aggregator()
    export_rate, raw_rate, _, ratios = bench_end_to_end(
        args.records, args.batch, args.rounds, args.stream
    )
    ratio = export_rate / raw_rate
    print("with the aggregator process's GC setting (tune_gc_for_aggregator):")
    print(f"end to end (submit -> JSONL lines on disk): {export_rate:,.0f} records/s")
    print(f"raw baseline (prebuilt dicts -> orjson -> buffered write): {raw_rate:,.0f} records/s")
    print(
        f"export/raw: {ratio:.3f} (best rounds); per round: "
        + ", ".join(f"{r:.3f}" for r in ratios)
    )

    p50, p99, worst, submits, dropped = bench_submit_latency(args.batch, args.latency_seconds)
    print(
        f"submit() with a saturated worker: p50 {p50:.1f} us, p99 {p99:.1f} us, "
        f"max {worst:.1f} us over {submits:,} submits ({dropped:,} dropped, queue full)"
    )

    bound = args.bound_mib * 2**20
    over, n, dropped = bench_stalled_memory(args.batch, bound)
    print(
        f"stalled exporter, 10x the byte bound submitted ({n:,} batches, {dropped:,} dropped): "
        f"peak traced memory = {over:.2f} x the {args.bound_mib} MiB bound"
    )
    print(
        f"export_ratio_vs_raw={ratio:.3f} submit_p99_us={p99:.1f} stalled_peak_over_bound={over:.2f}"
    )


if __name__ == "__main__":
    main()
