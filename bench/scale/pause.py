"""--pause: SIGSTOP the aggregator under real ``RankSender``s."""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from traceml_ai.export._builder import batch_streams_for
from traceml_records import parse_export_streams

from .aggregator import QueueBounds, start_aggregator
from .check import read_keys, validate
from .items import WIRE_ORDER, LoadSpec, process_item, runtime_item, step_events, system_item

# -- aggregator pause with real RankSenders -----------------------------------------------


def _pause_rank_main(
    spec: LoadSpec, token: str, address: tuple[str, int], rank: int, conn: Connection
) -> None:
    """One real rank: a RankSender and a fake training loop timing its steps."""
    from traceml_ai.transport import RankSender

    ident = spec.identity(rank)
    sender = RankSender(address, token, ident)
    connects = [0]
    original = sender._connect

    def counting_connect(timeout: float) -> None:
        connects[0] += 1
        original(timeout)

    sender._connect = counting_connect  # type: ignore[method-assign]
    local = rank % spec.ranks_per_node
    device = f"cuda:{local}"
    events = step_events(device)
    put = dict.fromkeys(WIRE_ORDER, 0)  # a real rank sends every stream
    t0 = conn.recv()
    while time.monotonic() < t0:
        time.sleep(0.001)
    sender.start()
    period = 1.0 / spec.steps_per_s
    steps: list[tuple[float, float, float]] = []
    next_sample = 0.0
    for k in range(spec.total_steps):
        due = t0 + k * period
        now = time.monotonic()
        if due > now:
            time.sleep(due - now)
        begin = time.perf_counter()
        # The "training": a fixed amount of pure-Python work (holds the GIL, like a
        # Python training loop's own overhead).
        acc = 0
        for i in range(2_000):
            acc += i * i
        p0 = time.perf_counter()
        ts = time.time_ns()
        sender.put(
            "step_time", {"timestamp_unix_ns": ts, "seq": k, "step": k + 1, "events": events}
        )
        sender.put(
            "step_memory",
            {
                "timestamp_unix_ns": ts,
                "seq": k,
                "step": k + 1,
                "device": device,
                "peak_allocated_bytes": 10**9,
                "peak_reserved_bytes": 2 * 10**9,
            },
        )
        put["step_time"] += 1
        put["step_memory"] += 1
        if k == 0:
            sender.put("runtime_environment", runtime_item(ts, spec.ranks, spec.ranks_per_node))
            put["runtime_environment"] += 1
        if time.monotonic() - t0 >= next_sample:
            next_sample += spec.sampler_interval_s
            sender.put("process", process_item(put["process"], ts, local))
            put["process"] += 1
            if local == 0:
                sender.put("system", system_item(put["system"], ts, spec.gpus))
                put["system"] += 1
        end = time.perf_counter()
        steps.append((time.monotonic() - t0, end - begin, end - p0))
    sender.close(timeout=10)
    conn.send(
        {
            "rank": rank,
            "put": put,
            "steps": steps,
            "sent_items": sender.sent_items,
            "dropped_items": sender.dropped_items,
            "dropped_by_stream": sender.dropped_items_by_stream,
            "dropped_batches_by_stream": sender.dropped_batches_by_stream,
            "sent_batches": sender.sent_batches,
            "dropped_batches": sender.dropped_batches,
            "connects": connects[0],
        }
    )


def run_pause(
    spec: LoadSpec,
    streams: str,
    *,
    logs_dir: Path,
    pause_at: float,
    pause_s: float,
    do_validate: bool,
    bounds: QueueBounds | None = None,
) -> dict[str, Any]:
    """SIGSTOP the aggregator for ``pause_s`` seconds mid-run while real senders go on."""
    files = parse_export_streams(streams)
    token = f"pause-{os.getpid()}"
    agg = start_aggregator(logs_dir, "pause", spec, streams, token, bounds)
    ctx = mp.get_context("fork")
    procs = []
    for rank in range(spec.ranks):
        parent, child = ctx.Pipe()
        p = ctx.Process(
            target=_pause_rank_main, args=(spec, token, agg.address, rank, child), daemon=True
        )
        p.start()
        procs.append((p, parent))
    agg.sample_every(0.25)
    t0 = time.monotonic() + 1.0
    for _, conn in procs:
        conn.send(t0)
    time.sleep(max(0.0, t0 + pause_at - time.monotonic()))
    os.kill(agg.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    time.sleep(pause_s)
    os.kill(agg.pid, signal.SIGCONT)
    resumed = time.monotonic()
    results = []
    for p, conn in procs:
        if not conn.poll(spec.seconds + 120):
            raise RuntimeError("a rank did not finish")
        results.append(conn.recv())
        p.join(10)
    if not agg.wait(120):
        agg.popen.send_signal(signal.SIGTERM)
        agg.wait(60)
    stats_path = agg.run_dir / "aggregator" / "stats.json"
    stats = orjson.loads(stats_path.read_bytes()) if stats_path.exists() else {}
    a, b = stopped - t0, resumed - t0
    windows: dict[str, list[float]] = {"before": [], "during": [], "after": []}
    for res in results:
        for t, step_s, _ in res["steps"]:
            key = "before" if t < a else "during" if t < b + 2.5 else "after"
            windows[key].append(step_s * 1000)
    # Accounting: per (rank, stream), the seqs written; missing = put - written.
    export = agg.run_dir / "aggregator" / "export"
    fields = {
        "step_time": ("global_rank", "seq"),
        "step_memory": ("global_rank", "seq"),
        "process": ("global_rank", "seq"),
        "system": ("node_rank", "seq"),
        "runtime_environment": ("global_rank", "seq"),
    }
    written = dup = missing_items = out_of_order = 0
    closing_dropped = set()
    for stream, flds in fields.items():
        if stream not in files:
            continue
        cols, closing = read_keys(export / f"{stream}.jsonl", flds)
        if closing:
            closing_dropped.add(closing["dropped_batches"])
        keys = list(zip(*cols, strict=True))
        written += len(keys)
        dup += len(keys) - len(set(keys))
        last: dict[int, int] = {}
        for who, seq in keys:  # file order: a rank's seq never decreases
            out_of_order += seq < last.get(who, -1)
            last[who] = seq
        for res in results:
            rank = res["rank"]
            if stream == "system" and rank % spec.ranks_per_node:
                continue
            who = rank // spec.ranks_per_node if stream == "system" else rank
            seqs = {s for w, s in keys if w == who}
            n_put = res["put"][stream]
            dup += sum(1 for s in seqs if s >= n_put)
            missing_items += n_put - len(seqs)
    sender_dropped = sum(r["dropped_items"] for r in results)
    # Ranks send every stream; only the drops of exported ones can be missing from files.
    exported = batch_streams_for(files)
    sender_dropped_exported = sum(
        n for r in results for stream, n in r["dropped_by_stream"].items() if stream in exported
    )
    # The aggregator's dropped_batches includes what the senders reported dropping in
    # exported streams; only the rest was dropped by the aggregator itself.
    sender_dropped_exported_batches = sum(
        n
        for r in results
        for stream, n in r["dropped_batches_by_stream"].items()
        if stream in exported
    )
    agg_dropped = int(stats.get("dropped_batches", -1))
    queue_dropped = agg_dropped - sender_dropped_exported_batches
    return {
        "stopped_at": a,
        "paused_s": b - a,
        "windows": windows,
        "results": results,
        "stats": stats,
        "written": written,
        "duplicates": dup,
        "out_of_order": out_of_order,
        "missing_items": missing_items,
        "sender_dropped_items": sender_dropped,
        "sender_dropped_exported_items": sender_dropped_exported,
        "sender_dropped_batches": sum(r["dropped_batches"] for r in results),
        "agg_dropped_batches": agg_dropped,
        "sender_dropped_exported_batches": sender_dropped_exported_batches,
        "queue_dropped_batches": queue_dropped,
        "closing_dropped": sorted(closing_dropped),
        "exact": dup == 0
        and missing_items == sender_dropped_exported
        and queue_dropped == 0
        and closing_dropped <= {agg_dropped},
        "valid": validate(agg.run_dir) if do_validate else None,
        "peak_rss_mb": max((x.hwm for x in agg.samples), default=0) / 2**20,
    }


def pause(args: argparse.Namespace, spec: LoadSpec, logs_dir: Path) -> None:
    r = run_pause(
        spec,
        args.streams,
        logs_dir=logs_dir,
        pause_at=args.pause_at,
        pause_s=args.pause_s,
        do_validate=not args.no_validate,
        bounds=args.bounds,
    )
    results, stats = r["results"], r["stats"]
    print(
        f"pause: {spec.ranks} real RankSenders (one process each), {spec.steps_per_s:g} steps/s, "
        f"{spec.seconds:g} s; aggregator SIGSTOPped at {r['stopped_at']:.1f} s for "
        f"{r['paused_s']:.1f} s"
    )
    for key, vals in r["windows"].items():
        if vals:
            v = np.asarray(vals)
            print(
                f"  step body ({key:6s}; 'during' = pause + 2.5 s): n={len(v):,} p50 "
                f"{np.percentile(v, 50):.3f} ms p99 {np.percentile(v, 99):.3f} ms "
                f"max {v.max():.3f} ms"
            )
    print(
        f"  senders: {sum(x['sent_batches'] for x in results):,} batches sent, "
        f"{r['sender_dropped_batches']:,} dropped ({r['sender_dropped_items']:,} items); "
        f"connects per rank {sorted(x['connects'] for x in results)}"
    )
    print(
        f"  aggregator: dropped batches {r['agg_dropped_batches']} (reported by senders "
        f"{r['sender_dropped_exported_batches']}, its queue {r['queue_dropped_batches']}), "
        "rejected frames "
        f"{stats.get('rejected_by_reason', {})}, connections {stats.get('connections_total')} "
        f"(held behind an older one of the same rank: {stats.get('held_connections')}), "
        f"closing dropped_batches {r['closing_dropped']}"
    )
    print(
        f"  accounting: written {r['written']:,}, missing items {r['missing_items']:,} = dropped "
        f"by senders in exported streams {r['sender_dropped_exported_items']:,} (all streams "
        f"{r['sender_dropped_items']:,}) + aggregator-dropped "
        f"{'0' if r['queue_dropped_batches'] == 0 else '?'}: "
        f"{'EXACT' if r['exact'] else 'NOT EXACT'} (duplicates {r['duplicates']}, "
        f"seq out of order {r['out_of_order']})"
    )
    if r["valid"] is not None:
        ok, secs, line = r["valid"]
        print(f"  traceml validate: {'ok' if ok else 'FAILED'} ({secs:.0f} s): {line}")
    print(
        f"ranks={spec.ranks} steps_per_s={spec.steps_per_s:g} "
        f"records_per_s={r['written'] / spec.seconds:.0f} "
        f"dropped_batches={r['queue_dropped_batches'] + r['sender_dropped_batches']} "
        f"peak_rss_mb={r['peak_rss_mb']:.0f} max_sustained_records_per_s=0"
    )
