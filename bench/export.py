"""Export engine figures: end-to-end step_time throughput, submit latency, stalled memory.

Prints figures only; never passes or fails. The last line is machine-readable:

    export_ratio_vs_raw=<x> submit_p99_us=<y> stalled_peak_over_bound=<z>

- end to end: wire batches as the server queues them (still encoded) →
  ``ExportPipeline.submit`` → RecordBuilder (line mode) → JsonlExporter → lines on
  disk (``finalize`` included, so the closing lines too), next to a raw baseline in
  the same run: the same lines as prebuilt dicts → ``orjson.dumps`` → a buffered
  file write. Export and raw alternate for ``--rounds`` rounds and the best round of
  each counts. Measured first with CPython's default GC thresholds, then with the
  setting every aggregator process runs with (``tune_gc_for_aggregator``); the
  machine-readable ratio is the latter, the aggregator as deployed.
- submit latency: ``submit()`` p50/p99/max while the worker is saturated (a backlog
  is always queued, so the worker thread competes for the GIL the whole time).
- stalled memory: the exporter blocks in ``export``; 10x the queue's byte bound of
  freshly decoded batches is submitted; the peak of traced Python memory above the
  start is compared with the byte bound (which counts wire bytes, not objects).

    python -m bench.export [--records 200000] [--batch 100]
"""

from __future__ import annotations

import argparse
import gc
import shutil
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

IDENTITY = make_identity(0, world_size=2, local_world_size=2, pid=1234)
PHASES = ("dataloader_next", "forward_time", "backward_time", "optimizer_step", "step_time")


def step_time_item(seq: int) -> dict[str, Any]:
    """A CPU step as the rank SDK sends it: five built-in phases."""
    events = {
        f"_traceml_internal:{name}": {"cpu": make_phase(1.0 + k + seq % 7 / 8)}
        for k, name in enumerate(PHASES)
    }
    return make_item("step_time", seq, events=events)


def frame(first_seq: int, n: int) -> bytes:
    """One batch message body, as a rank sends it."""
    items = [step_time_item(seq) for seq in range(first_seq, first_seq + n)]
    return make_batch_body("step_time", items, IDENTITY)


def received(body: bytes) -> ReceivedBatch:
    """A batch as the aggregator's server queues it: the frame body, still encoded (a
    fresh copy each time, as each frame arrives in its own buffer)."""
    return ReceivedBatch(time.time_ns(), bytes(bytearray(body)), len(body))


def _raw_dicts(batches: list[ReceivedBatch]) -> list[dict[str, Any]]:
    """The lines of ``batches`` as prebuilt dicts (what the raw baseline serializes)."""
    return [
        {
            "stream": "step_time",
            "schema_version": 1,
            "observed_timestamp_unix_ns": b.observed_timestamp_unix_ns,
            "rank": 0,
            "global_rank": 0,
            "local_rank": 0,
            "world_size": 2,
            "local_world_size": 2,
            "node_rank": 0,
            **item,
        }
        for b in batches
        for item in orjson.loads(b.payload)["items"]
    ]


def _export_once(bodies: list[bytes], total: int, tmp: Path) -> float:
    """Seconds from the first submit to finalize() returning, all lines on disk."""
    batches = [received(b) for b in bodies]
    run_dir = tmp / f"run-{time.monotonic_ns()}"
    settings = ExportSettings(exporter="jsonl", export_streams="step_time")
    begin = time.perf_counter()
    pipeline = start_export(
        settings, run_dir, max_queue_batches=len(batches) + 1, max_queue_bytes=2**40
    )
    assert pipeline is not None and pipeline.failure is None
    for b in batches:
        pipeline.submit(b)
    stats = pipeline.finalize(timeout=600.0)
    took = time.perf_counter() - begin
    path = run_dir / "aggregator" / "export" / "step_time.jsonl"
    lines = path.read_bytes().count(b"\n")
    assert stats.written_records["step_time"] == total and lines == total + 1, (stats, lines)
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
    records: int, per_batch: int, rounds: int
) -> tuple[float, float, float, list[float]]:
    """(export records/s, raw records/s, build-only records/s, per-round ratios).

    Export and raw alternate for ``rounds`` rounds; each rate is the best round's
    (the least disturbed by whatever else the machine did), and the per-round
    ratios show the spread.
    """
    bodies = [frame(i, per_batch) for i in range(0, records, per_batch)]
    batches = [received(b) for b in bodies]
    total = len(batches) * per_batch

    # Build only: the aggregator-side cost before any file write (record mode).
    builder = RecordBuilder(("step_time",), include_hostname=False)
    begin = time.perf_counter()
    built = sum(builder.build(b).record_count for b in batches)
    build_rate = built / (time.perf_counter() - begin)

    export_s: list[float] = []
    raw_s: list[float] = []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(rounds):
            gc.collect()
            export_s.append(_export_once(bodies, total, Path(tmp)))
            # Built per round and dropped after: 200,000 live dicts would otherwise
            # sit in the GC's way during the next export round.
            dumps = _raw_dicts(batches)
            gc.collect()
            raw_s.append(raw_once(dumps, Path(tmp)))
            del dumps
    ratios = [r / e for e, r in zip(export_s, raw_s, strict=True)]
    return total / min(export_s), total / min(raw_s), build_rate, ratios


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
    args = parser.parse_args(argv)

    # First with CPython's default GC thresholds, then as an aggregator process runs.
    default_export, default_raw, build_rate, default_ratios = bench_end_to_end(
        args.records, args.batch, args.rounds
    )
    print(f"build only (RecordBuilder record mode, step_time): {build_rate:,.0f} records/s")
    print(
        f"default GC: end to end {default_export:,.0f} records/s, raw {default_raw:,.0f}"
        f" records/s: {default_export / default_raw:.3f} (per round: "
        + ", ".join(f"{r:.3f}" for r in default_ratios)
        + ")"
    )
    tune_gc_for_aggregator()
    export_rate, raw_rate, _, ratios = bench_end_to_end(args.records, args.batch, args.rounds)
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
