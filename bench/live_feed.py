"""The live feed's cost per step, in process, split by part; this tree against another.

Builds the encoded batches ``bench.scale``'s generator sends for a job of ``--ranks``
ranks at ``--steps-per-s`` steps a second, flushing 4 times a second (2 or 3 steps per
``step_time``, ``step_memory`` and ``collectives`` batch; ``process`` and ``system``
every 2 s), for ``--seconds`` seconds, and feeds them to a fresh
:class:`~traceml_ai.monitor._feed.LiveFeed` (its ``_take``, on this thread: the feed's
work without its queue and sleeps), ``--repeat`` times in one process (the least
of each part is kept: CPU time, so the machine's other processes count little).
Prints per step (µs):

- ``parse``: decoding the batches (``decode_batch_body``; a tree whose feed scans
  batches, ``_feedscan``: its scan of step_time, collectives and step_memory ones);
- ``step_row``: the step rule (``analysis.step_row``) over the decoded step items (0
  for a tree that scans: the scan applies it);
- ``hists``: the rest of the ``step_time`` batches' state updates (histograms, window,
  tokens, the steps handed on);
- ``waits``: the ``collectives`` batches' state updates;
- ``gauges``: the ``step_memory``, ``process``, ``system``, ``runtime_environment``
  batches' state updates;
- ``take``: the whole ``_take`` (parse + the state's updates);
- ``otlp``: the traces' sampler and the spans of the sampled steps
  (``--trace-sample``, 1 in 100 by default);
- ``straggler``: one straggler analysis of the state, spread over the steps of one
  ``STRAGGLER_PERIOD_S`` (the most often the feed runs it; with only Prometheus and
  OTLP on, it runs only when a scrape or an export reads it, so as often as they
  come, at most once a period).

``--baseline PATH`` (another checkout, e.g. a ``git worktree`` of the commit before)
runs the same measurement with that tree's code, the two trees taking turns in
subprocesses ``--rounds`` times; the last line is ``feed_step_us=<this tree's take +
otlp + straggler, median> baseline_feed_step_us=<the other's> feed_step_ratio=<this
over baseline>``.

    python -m bench.live_feed --baseline ../before --rounds 3
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PARTS = ("parse", "step_row", "hists", "waits", "gauges", "take", "otlp", "straggler")


def _batches(ranks: int, steps_per_s: float, seconds: float) -> tuple[list[Any], int]:
    """The generator's batches (encoded, as received) in arrival order; and the steps."""
    import orjson

    from traceml_ai.transport.wire import FRAME_HEADER, ReceivedBatch, make_batch_message

    from .scale.items import LoadSpec, collectives_item, process_item, step_events, system_item

    spec = LoadSpec(ranks=ranks, steps_per_s=steps_per_s, seconds=seconds)
    events = [step_events(f"cuda:{r % 8}") for r in range(ranks)]
    out: list[Any] = []

    def add(rank: int, stream: str, items: list[dict[str, Any]]) -> None:
        body = orjson.dumps(make_batch_message("t" * 43, spec.identity(rank), stream, items))
        out.append(ReceivedBatch(time.time_ns(), body, len(body) + FRAME_HEADER.size))

    flushes = round(seconds * spec.flush_hz)
    done = [0] * ranks
    ts = time.time_ns()
    for f in range(1, flushes + 1):
        elapsed = f / spec.flush_hz
        steps = min(spec.total_steps, int(elapsed * steps_per_s))
        for r in range(ranks):
            a = done[r]
            if steps > a:
                done[r] = steps
                ts += 1000
                add(
                    r,
                    "step_time",
                    [
                        {"timestamp_unix_ns": ts, "seq": k, "step": k + 1, "events": events[r]}
                        for k in range(a, steps)
                    ],
                )
                add(
                    r,
                    "step_memory",
                    [
                        {
                            "timestamp_unix_ns": ts,
                            "seq": k,
                            "step": k + 1,
                            "device": f"cuda:{r % 8}",
                            "peak_allocated_bytes": 20_000_000_000 + k,
                            "peak_reserved_bytes": 24_000_000_000,
                        }
                        for k in range(a, steps)
                    ],
                )
                add(r, "collectives", [collectives_item(k, ts) for k in range(a, steps)])
            if f % round(spec.sampler_interval_s * spec.flush_hz) == 1:
                add(r, "process", [process_item(f, ts, r % 8)])
                if r % 8 == 0:
                    add(r, "system", [system_item(f, ts, 8)])
    return out, sum(done)


def measure(ranks: int, steps_per_s: float, seconds: float, trace_sample: int) -> dict[str, float]:
    """One measurement of this process's tree: µs per step of each part."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    from traceml_ai.analysis import step_row
    from traceml_ai.monitor._feed import STRAGGLER_PERIOD_S, LiveFeed
    from traceml_ai.monitor._otlp_traces import SpanBuilder, StepSampler
    from traceml_ai.monitor._state import LiveState, StepSeen
    from traceml_ai.monitor.metrics import DEFAULT_RANK_SERIES_MAX_RANKS
    from traceml_ai.transport.wire import decode_batch_body, peek_batch_stream

    batches, steps = _batches(ranks, steps_per_s, seconds)
    clock = time.process_time

    groups: dict[str, list[Any]] = {"steps": [], "waits": [], "gauges": []}
    for batch in batches:
        stream = peek_batch_stream(batch.payload)
        part = {"step_time": "steps", "collectives": "waits"}.get(stream or "", "gauges")
        groups[part].append(batch)
    parse: dict[str, float] = {}
    for part, group in groups.items():
        t = clock()
        for b in group:
            decode_batch_body(b.payload)
        parse[part] = clock() - t

    step_items = [i for b in groups["steps"] for i in decode_batch_body(b.payload)["items"]]
    cache: dict[str, str | None] = {}
    t = clock()
    for item in step_items:
        step_row(item["events"], cache=cache)
    row = clock() - t
    # The decoded items are not the aggregator's to hold: kept, their ~300,000 dicts
    # would make every full garbage collection during the takes below cost more.
    del step_items
    gc.collect()

    # The streams one after the other (each rank's state is made by its first step
    # batch either way), so that each one's share is measured apart.
    seen: list[list[StepSeen]] = []
    try:  # as Monitoring makes it: the default rank_series_max_ranks (64)
        state = LiveState(rank_histograms_max_ranks=DEFAULT_RANK_SERIES_MAX_RANKS)
    except TypeError:  # a tree whose state keeps every rank's histograms
        state = LiveState()
    feed = LiveFeed(state)
    feed.add_listener(lambda s: seen.append(list(s)))
    take: dict[str, float] = {}
    for part, group in groups.items():
        t = clock()
        for batch in group:
            feed._take(batch)
        take[part] = clock() - t

    # A tree whose feed scans step_time batches (_feedscan): its parse of those is the
    # scan (the names are known by now), and it runs no step_row.
    from traceml_ai.monitor import _feed

    scan = getattr(_feed, "SCAN_STEP_TIME", None)
    if scan is not None:
        labels = state.scan_labels
        t = clock()
        for batch in groups["steps"]:
            scan(batch.payload, labels)
        parse["steps"] = clock() - t
        row = 0.0
    # ...and one that scans collectives and step_memory batches into rows: that scan.
    scan_items = getattr(_feed, "SCAN_ITEMS", None)
    row_keys: dict[str, tuple[str, ...]] = getattr(_feed, "_ROW_KEYS", {})
    if scan_items is not None:
        for part in ("waits", "gauges"):
            t = clock()
            for batch in groups[part]:
                stream = peek_batch_stream(batch.payload) or ""
                if stream in row_keys:
                    scan_items(batch.payload, stream, row_keys[stream])
                else:
                    decode_batch_body(batch.payload)
            parse[part] = clock() - t

    sampler = StepSampler(trace_sample)
    builder = SpanBuilder(InstrumentationScope("bench"))
    resource = Resource.create({})
    t = clock()
    for group in seen:
        for step, reason in sampler.pick(group):
            builder.spans(step, reason, resource)
    otlp = clock() - t

    t = clock()
    feed._analyze_straggler()
    straggler = clock() - t
    assert feed.state.straggler is not None
    period_steps = ranks * steps_per_s * STRAGGLER_PERIOD_S

    us = 1e6 / steps
    return {
        "parse": sum(parse.values()) * us,
        "step_row": row * us,
        "hists": (take["steps"] - parse["steps"] - row) * us,
        "waits": (take["waits"] - parse["waits"]) * us,
        "gauges": (take["gauges"] - parse["gauges"]) * us,
        "take": sum(take.values()) * us,
        "otlp": otlp * us,
        "straggler": straggler * 1e6 / period_steps,
        "steps": steps,
    }


def _run_tree(root: Path, args: argparse.Namespace) -> dict[str, float]:
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{Path(__file__).parent.parent}")
    cmd = [sys.executable, "-m", "bench.live_feed", "--one", *_shape(args)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _shape(args: argparse.Namespace) -> list[str]:
    return [
        f"--ranks={args.ranks}",
        f"--steps-per-s={args.steps_per_s}",
        f"--seconds={args.seconds}",
        f"--trace-sample={args.trace_sample}",
        f"--repeat={args.repeat}",
    ]


def _total(f: dict[str, float]) -> float:
    return f["take"] + f["otlp"] + f["straggler"]


def _line(name: str, f: dict[str, float]) -> str:
    parts = " ".join(f"{p}={f[p]:.2f}" for p in PARTS)
    return f"{name:9s} µs/step: {parts} total={_total(f):.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--trace-sample", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--repeat", type=int, default=3, help="measurements per run (min of)")
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        measured = [
            measure(args.ranks, args.steps_per_s, args.seconds, args.trace_sample)
            for _ in range(args.repeat)
        ]
        print(json.dumps({part: min(m[part] for m in measured) for part in measured[0]}))
        return
    here = Path(__file__).resolve().parent.parent
    trees = [("this", here)] + ([("baseline", args.baseline.resolve())] if args.baseline else [])
    runs: dict[str, list[dict[str, float]]] = {name: [] for name, _ in trees}
    for _ in range(args.rounds):
        for name, root in trees:
            figures = _run_tree(root, args)
            runs[name].append(figures)
            print(_line(name, figures), flush=True)
    mine = statistics.median(_total(f) for f in runs["this"])
    line = f"feed_step_us={mine:.2f}"
    if args.baseline:
        base = statistics.median(_total(f) for f in runs["baseline"])
        line += f" baseline_feed_step_us={base:.2f} feed_step_ratio={mine / base:.3f}"
    print(line)


if __name__ == "__main__":
    main()
