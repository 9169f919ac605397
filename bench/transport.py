"""Loopback transport throughput: N rank processes with a RankSender → one AggregatorServer.

Prints figures only (batches/s, items/s, MB/s, cost of ``put``); never passes or fails.

    python -m bench.transport --senders 4 --items 200000
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import threading
import time
from typing import Any

from traceml_ai.testing import make_item, make_phase
from traceml_ai.transport import AggregatorServer, RankSender
from traceml_ai.transport.wire import ReceivedBatch, new_run_token


def step_time_item(seq: int) -> dict[str, Any]:
    """An item shaped like a real step_time item (about 600 bytes of JSON)."""
    events = {
        f"_traceml_internal:{name}": {"cpu": make_phase(1.5)}
        for name in ("forward_time", "backward_time", "optimizer_step", "step_time")
    }
    return make_item("step_time", seq, timestamp_unix_ns=time.time_ns(), step=seq, events=events)


def rank_main(
    address: tuple[str, int], token: str, rank: int, items: int, batch: int, result: Any
) -> None:
    """Put ``items`` items as fast as the sender keeps up with, then close."""
    sender = RankSender(
        address,
        token,
        {"global_rank": rank, "pid": os.getpid(), "hostname": None},
        flush_interval_s=0.05,
        max_items_per_batch=batch,
    )
    sender.start()
    template = [step_time_item(i) for i in range(1_000)]
    put_ns = 0
    for seq in range(items):
        item = template[seq % 1_000]
        begin = time.perf_counter_ns()
        sender.put("step_time", item)
        put_ns += time.perf_counter_ns() - begin
        # Pace the producer to the link so the figure is throughput, not drops.
        if seq % 1_000 == 999:
            while sender.pending_items > 10_000:
                time.sleep(0.001)
    sender.close(timeout=30)
    result.put((rank, sender.sent_items, sender.dropped_items, put_ns / max(items, 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--items", type=int, default=100_000, help="items per sender")
    parser.add_argument("--batch", type=int, default=1_000, help="max items per batch")
    args = parser.parse_args()

    token = new_run_token()
    lock = threading.Lock()
    counts = {"batches": 0, "items": 0, "bytes": 0, "finished": 0}
    first_ns: list[int] = []
    last_ns: list[int] = []

    def on_batch(batch: ReceivedBatch) -> None:
        with lock:
            if not first_ns:
                first_ns.append(batch.observed_timestamp_unix_ns)
            counts["batches"] += 1
            # The server hands batches on still encoded (the export worker parses
            # them); count items without parsing: each carries one "seq" key.
            payload = batch.payload
            counts["items"] += (
                payload.count(b'"seq":') if isinstance(payload, bytes) else len(payload["items"])
            )
            counts["bytes"] += batch.nbytes

    def on_finished(message: dict[str, Any]) -> None:
        with lock:
            counts["finished"] += 1
            last_ns[:] = [time.time_ns()]

    server = AggregatorServer("127.0.0.1", 0, token, on_batch, on_finished)
    address = server.start()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=rank_main, args=(address, token, r, args.items, args.batch, results))
        for r in range(args.senders)
    ]
    for proc in procs:
        proc.start()
    per_rank = [results.get() for _ in procs]
    for proc in procs:
        proc.join()
    deadline = time.monotonic() + 10
    while counts["finished"] < args.senders and time.monotonic() < deadline:
        time.sleep(0.01)
    server.stop()

    seconds = max((last_ns[0] - first_ns[0]) / 1e9, 1e-9) if first_ns and last_ns else float("nan")
    sent = sum(r[1] for r in per_rank)
    dropped = sum(r[2] for r in per_rank)
    put_ns = sum(r[3] for r in per_rank) / len(per_rank)
    print(
        f"senders={args.senders} items/sender={args.items} batch={args.batch} cpus={os.cpu_count()}"
    )
    print(f"received: {counts['batches']} batches, {counts['items']} items in {seconds:.2f} s")
    print(f"batches/s: {counts['batches'] / seconds:,.0f}")
    print(f"items/s:   {counts['items'] / seconds:,.0f}")
    print(f"MB/s:      {counts['bytes'] / seconds / 1e6:,.1f}")
    print(f"sender: sent_items={sent} dropped_items={dropped} mean put={put_ns:.0f} ns")
    print(
        f"server: rejected_frames={server.rejected_frames} callback_errors={server.callback_errors}"
    )


if __name__ == "__main__":
    main()
