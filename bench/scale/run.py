"""One run: load, aggregator, checks, figures."""

from __future__ import annotations

import itertools
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from traceml_records import parse_export_streams

from .aggregator import AggregatorProc, QueueBounds, Sample, start_aggregator
from .check import Check, check_files, validate
from .generator import generator_main
from .items import LoadSpec

# -- one run ------------------------------------------------------------------------------


@dataclass
class RunResult:
    spec: LoadSpec
    generated_records: int
    written_records: int
    records_per_s: float
    offered_records_per_s: float
    agg_dropped_batches: int
    sender_dropped_batches: int
    cpu_s_per_1k: float
    agg_cpu_cores: float
    gen_cpu_cores: float
    peak_rss_mb: float
    idle_rss_mb: float
    queue_hw_batches: int
    queue_hw_bytes: int
    max_queue_bytes: int
    drain_s: float
    gen_max_lag_s: float
    gen_max_flush_ms: float
    gen_max_pending_kib: float
    check: Check
    stats: dict[str, Any]
    samples: list[Sample]
    t0: float
    valid: tuple[bool, float, str] | None

    @property
    def dropped(self) -> int:
        return self.agg_dropped_batches + self.sender_dropped_batches

    @property
    def sustained(self) -> bool:
        """No batch lost anywhere, exact accounting, the generator kept its schedule, and
        the queue never got past half its byte bound (a queue that fills up slowly over a
        probe would drop in a longer run)."""
        headroom = self.max_queue_bytes <= 0 or self.queue_hw_bytes <= self.max_queue_bytes / 2
        return self.dropped == 0 and self.check.exact and self.gen_max_lag_s < 0.5 and headroom


Child = tuple[Any, Connection, Path]
"""A run's child process, the parent's end of its pipe, the file its result is pickled to."""


def spans(first: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``[first, end)`` cut into ``parts`` runs of about the same length."""
    edges = np.linspace(first, end, parts + 1).astype(int)
    return [(int(a), int(b)) for a, b in itertools.pairwise(edges)]


def start_children(
    ctx: Any, target: Callable[..., None], args: Sequence[tuple[Any, ...]], workdir: Path, name: str
) -> list[Child]:
    """One process of ``target(*args, conn, out_path)`` per ``args``; each says
    ``connected`` when ready, waits for the start time, and says ``done`` once its
    result is in ``out_path``."""
    children: list[Child] = []
    for i, each in enumerate(args):
        parent, child = ctx.Pipe()
        out_path = workdir / f"{name}{i}.pkl"
        proc = ctx.Process(target=target, args=(*each, child, str(out_path)), daemon=True)
        proc.start()
        children.append((proc, parent, out_path))
    return children


def wait_connected(children: Sequence[Child], what: str) -> None:
    for _, conn, _ in children:
        if (msg := conn.recv()) != "connected":
            raise RuntimeError(f"{what} failed: {msg}")


def results_of(children: Sequence[Child], timeout_s: float, what: str) -> list[dict[str, Any]]:
    """Each child's result, once it said ``done``."""
    results = []
    for proc, conn, out_path in children:
        if not conn.poll(timeout_s):
            raise RuntimeError(f"{what} did not finish")
        if (msg := conn.recv()) != "done":
            raise RuntimeError(f"{what} failed: {msg}")
        proc.join(30)
        results.append(pickle.loads(out_path.read_bytes()))
    return results


def await_aggregator(agg: AggregatorProc, spec: LoadSpec) -> None:
    """Wait for the aggregator to finalize on its own once the load ended (a backlog,
    on a starved machine, takes longer to drain the more ranks sent it)."""
    if not agg.wait(max(180.0, spec.ranks / 40)):
        agg.popen.send_signal(signal.SIGTERM)
        agg.wait(90)
        raise RuntimeError("aggregator did not finalize on its own")


def kill_all(children: Sequence[Child], agg: AggregatorProc) -> None:
    """After a failure: every child process still running, and the aggregator."""
    for proc, _, _ in children:
        if proc.is_alive():
            proc.kill()
    if agg.exit_t is None:
        agg.kill()


def run_once(
    spec: LoadSpec,
    export_streams: str,
    *,
    logs_dir: Path,
    run_name: str,
    procs: int,
    do_validate: bool,
    sample_interval_s: float = 0.25,
    during: Callable[[AggregatorProc, float], None] | None = None,
    before_load: Callable[[AggregatorProc], None] | None = None,
    quiet: bool = False,
    bounds: QueueBounds | None = None,
    route: Callable[[tuple[str, int], str], Sequence[tuple[str, int]]] | None = None,
    after_load: Callable[[], None] | None = None,
) -> RunResult:
    """One run. ``route(aggregator address, token)`` gives where the ranks send instead
    of the aggregator (relays in front of it): one address for all ranks, or one per
    node; ``after_load`` runs once the generators are done, before the aggregator is
    waited for (stopping those relays, which forwards what they hold)."""
    files = parse_export_streams(export_streams)
    token = f"scale-{os.getpid()}-{time.monotonic_ns()}"
    agg = start_aggregator(logs_dir, run_name, spec, export_streams, token, bounds)
    ctx = mp.get_context("fork")
    workdir = Path(tempfile.mkdtemp(prefix="scale-gen-"))
    gens: list[Child] = []
    try:
        addresses = list(route(agg.address, token)) if route is not None else [agg.address]
        gens = start_children(ctx, generator_main, [
            (spec, token, addresses, first, end)
            for first, end in spans(0, spec.ranks, procs)
        ], workdir, "gen")  # fmt: skip
        wait_connected(gens, "generator")
        time.sleep(0.5)
        if before_load is not None:
            before_load(agg)  # e.g. until a tracker's start-up work is done (bench.trackers)
        idle = agg.sample_now()
        assert idle is not None
        agg.sample_every(sample_interval_s)
        t0 = time.monotonic() + 0.2
        for _, conn, _ in gens:
            conn.send(t0)
        if during is not None:
            during(agg, t0)
        results = results_of(gens, spec.seconds + 600, "generator")
        gen_done = time.monotonic()
        if after_load is not None:
            after_load()
        await_aggregator(agg, spec)
    except BaseException:
        kill_all(gens, agg)
        raise
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    return finish_run(spec, agg, files, results, idle, t0, gen_done, do_validate, quiet)


def finish_run(
    spec: LoadSpec,
    agg: AggregatorProc,
    files: tuple[str, ...],
    results: list[dict[str, Any]],
    idle: Sample,
    t0: float,
    gen_done: float,
    do_validate: bool,
    quiet: bool,
) -> RunResult:
    """The figures of a run whose aggregator exited: ``results`` are the generators'
    (their logs of what each rank sent), ``idle`` the aggregator's sample before the load
    began at ``t0``, ``gen_done`` when the last generator finished."""
    logs: dict[int, dict[str, Any]] = {}
    for res in results:
        logs.update(res["logs"])
    stats_path = agg.run_dir / "aggregator" / "stats.json"
    stats = orjson.loads(stats_path.read_bytes()) if stats_path.exists() else {}
    check = check_files(agg.run_dir, spec, files, logs)
    valid = validate(agg.run_dir) if do_validate else None
    usage = agg.rusage
    agg_cpu_total = usage.ru_utime + usage.ru_stime
    load_s = max(agg.exit_t - t0, spec.seconds) if agg.exit_t else spec.seconds
    cpu_load = agg_cpu_total - idle.cpu_s
    written = check.written_records
    result = RunResult(
        spec=spec,
        generated_records=check.generated_records,
        written_records=written,
        records_per_s=written / spec.seconds,
        offered_records_per_s=check.generated_records / spec.seconds,
        # The aggregator's own drops: its dropped_batches less what the generator reported.
        agg_dropped_batches=int(stats.get("dropped_batches", check.agg_dropped_batches))
        - check.sender_dropped_selected_batches,
        sender_dropped_batches=sum(r["sender_dropped_batches"] for r in results),
        cpu_s_per_1k=cpu_load / max(written, 1) * 1000,
        agg_cpu_cores=cpu_load / load_s,
        gen_cpu_cores=sum(r["cpu_s"] for r in results) / spec.seconds,
        # VmHWM of the aggregator's own address space (ru_maxrss of wait4 would include
        # the image of the process that forked it, before exec).
        peak_rss_mb=max((x.hwm for x in agg.samples), default=0) / 2**20,
        idle_rss_mb=idle.rss / 2**20,
        queue_hw_batches=int(stats.get("queue_high_water_batches", -1)),
        queue_hw_bytes=int(stats.get("queue_high_water_bytes", -1)),
        max_queue_bytes=int(stats.get("max_queue_bytes") or 0),
        # From the end of the load schedule to the aggregator's exit (final flush, drain,
        # finalize).
        drain_s=(agg.exit_t or gen_done) - (t0 + spec.seconds),
        gen_max_lag_s=max(r["max_lag_s"] for r in results),
        gen_max_flush_ms=max(r["max_flush_s"] for r in results) * 1000,
        gen_max_pending_kib=max(r["max_pending_bytes"] for r in results) / 1024,
        check=check,
        stats=stats,
        samples=agg.samples,
        t0=t0,
        valid=valid,
    )
    if not quiet:
        report(result)
    return result


def report(r: RunResult) -> None:
    s, c = r.spec, r.check
    print(
        f"load: {s.ranks} ranks ({s.nodes} nodes x {s.ranks_per_node}, {s.gpus} GPUs/node), "
        f"{s.steps_per_s:g} steps/s, {s.seconds:g} s, streams {','.join(s.wire_streams)}"
    )
    print(
        f"records: generated {r.generated_records:,} ({r.offered_records_per_s:,.0f}/s), "
        f"written {r.written_records:,} ({r.records_per_s:,.0f}/s)"
    )
    print(
        f"aggregator: {r.cpu_s_per_1k:.4f} CPU s per 1,000 records, {r.agg_cpu_cores:.2f} cores, "
        f"peak RSS {r.peak_rss_mb:.0f} MB (idle with all connections {r.idle_rss_mb:.0f} MB), "
        f"queue high water {r.queue_hw_batches:,} batches / {r.queue_hw_bytes / 2**20:.1f} MiB, "
        f"drain after load {r.drain_s:.2f} s"
    )
    print(
        f"dropped batches: aggregator {r.agg_dropped_batches:,}, generator {r.sender_dropped_batches:,} "
        f"({c.sender_dropped_records:,} records); generator: {r.gen_cpu_cores:.2f} cores, "
        f"max lag {r.gen_max_lag_s * 1000:.0f} ms, longest flush {r.gen_max_flush_ms:.1f} ms, "
        f"max unsent {r.gen_max_pending_kib:.0f} KiB per connection"
    )
    print(
        f"accounting: {'EXACT' if c.exact else 'NOT EXACT'}: written {c.written_records:,} + "
        f"in aggregator-dropped batches {c.missing_records:,} ({c.missing_batches:,} batches, "
        f"aggregator says {c.agg_dropped_batches - c.sender_dropped_selected_batches:,} of its "
        f"{c.agg_dropped_batches:,}, the rest reported by the generator) + in "
        "generator-dropped batches "
        f"{c.sender_dropped_records:,} = {c.written_records + c.missing_records + c.sender_dropped_records:,}"
        f" of {c.generated_records:,} generated; duplicates {c.duplicates}, partial batches "
        f"{c.partial_batches}, unexpected {c.unexpected}, closing lines "
        f"{'ok' if c.closing_ok else 'WRONG'}"
        + (f"; problems: {c.problems[:5]}" if c.problems else "")
    )
    if r.valid is not None:
        ok, secs, line = r.valid
        print(f"traceml validate: {'ok' if ok else 'FAILED'} ({secs:.0f} s): {line}")


def final_line(r: RunResult, max_sustained: float) -> str:
    return (
        f"ranks={r.spec.ranks} steps_per_s={r.spec.steps_per_s:g} "
        f"records_per_s={r.records_per_s:.0f} dropped_batches={r.dropped} "
        f"peak_rss_mb={r.peak_rss_mb:.0f} max_sustained_records_per_s={max_sustained:.0f}"
    )
