"""Aggregator at scale: N simulated ranks over the real transport and wire format.

Prints figures and checks the files; never passes or fails on time. The aggregator is
a real ``traceml serve`` subprocess (``--exporter jsonl --export-streams <streams>
--aggregator-port 0 --nnodes N/8 --nproc-per-node 8``); the ranks are simulated by a
few generator processes, each holding one TCP connection per rank and sending what a
``RankSender`` would: every ``1/--flush-hz`` s per rank, one ``step_time``, one
``step_memory`` and one ``collectives`` batch (a DDP rank's all-reduces, a line per step)
with the steps done since the last flush, a ``process`` item
every ``--sampler-interval`` s, a ``system`` snapshot with ``--gpus`` GPUs from local
rank 0 of each node, one ``runtime_environment`` item at the start and ``finished``
at the end. Frames are encoded with the real ``make_batch_message``/``encode_frame``.

Modes (one per run):

    python -m bench.scale --ranks 1024 --steps-per-s 10 --seconds 60
    python -m bench.scale --ranks 1024 --find-max            # highest rate, 0 drops
    python -m bench.scale --ranks 1024 --steps-per-s 250 --seconds 30 --overload
    python -m bench.scale --ranks 1024 --steps-per-s 10 --soak     # 10 minutes
    python -m bench.scale --pause --ranks 8 --steps-per-s 100 --seconds 20
    python -m bench.scale --ranks 1024 --steps-per-s 1 --relays 128   # through relays
    python -m bench.scale --ranks 256 --steps-per-s 1 --relay-processes  # a process per node

``--relays N`` puts N relays (the relay's own code, ``--relay-procs`` processes holding
them) between the ranks and the aggregator: the ranks of node ``i`` send to relay
``i % N``, and the aggregator holds N connections. ``--relay-processes`` starts one real
relay process per node instead (``python -m traceml_ai.launch._relay_process``, as
``traceml run`` does on each node of a multi-node job). ``--replay-parts K`` runs the
load through ``--relays`` relays in ``K`` parts of the nodes, keeping what the relays
send, then replays all of it at once into the aggregator: a job larger than this machine
can simulate and receive at the same time (``bench/scale/replay.py``).

    python -m bench.scale --ranks 16384 --steps-per-s 1 --relays 2048 --replay-parts 8

(``--capture-dir PATH`` keeps the capture, and a later run with the same load and
``PATH`` replays it again: two aggregators, e.g. ``SCALE_AGGREGATOR_SRC``, take the same
traffic in turn.)

Accounting (exact, also with drops): every item of a (rank, wire stream) has its own
``seq`` (0, 1, 2, ...), and the generator logs each batch as (first seq, item count,
sent or dropped by the generator). After the run every record of the files is counted
by key. Every key must appear at most once; every batch the generator sent must be in
the files whole or not at all; the number of missing batches must equal the
aggregator's ``dropped_batches`` (closing lines, ``aggregator/stats.json``) less the
generator-dropped batches of selected streams, which the generator reports in its
``finished`` message and the aggregator counts too; so
records written + records in aggregator-dropped batches + records in generator-dropped
batches = records generated, batch by batch. Generator sockets are non-blocking: a
connection with more than ``--sender-buffer-kib`` unsent drops the batch (counted), so a
sender never blocks.

Last line: ``ranks=<n> steps_per_s=<s> records_per_s=<r> dropped_batches=<d>
peak_rss_mb=<m> max_sustained_records_per_s=<x>``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from traceml_ai.export._builder import batch_streams_for
from traceml_records import parse_export_streams

from .aggregator import QueueBounds
from .items import WIRE_ORDER, LoadSpec
from .modes import find_max, overload, soak
from .pause import pause
from .pyspy import print_profile, py_spy, summarize_profile
from .relays import RelayHosts, RelayProcesses
from .replay import run_replay
from .run import final_line, run_once


def main(argv: list[str] | None = None) -> None:
    doc = __doc__ or ""
    parser = argparse.ArgumentParser(
        description=doc.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps-per-s", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--streams", default="all", help="export_streams of the aggregator")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--gpus", type=int, default=8, help="GPUs per system snapshot")
    parser.add_argument("--flush-hz", type=float, default=4.0)
    parser.add_argument("--sampler-interval", type=float, default=2.0)
    parser.add_argument("--procs", type=int, default=2, help="generator processes")
    parser.add_argument("--sender-buffer-kib", type=int, default=4096)
    parser.add_argument("--logs-dir", type=Path, default=None, help="default: a temporary folder")
    parser.add_argument("--keep", action="store_true", help="keep the run folders")
    parser.add_argument("--no-validate", action="store_true")
    parser.add_argument(
        "--py-spy", type=Path, default=None, help="profile the aggregator into this raw file"
    )
    parser.add_argument("--summarize", type=Path, default=None, help="print a raw profile")
    parser.add_argument("--relays", type=int, default=0, help="relays between ranks and aggregator")
    parser.add_argument("--relay-procs", type=int, default=2, help="processes holding them")
    parser.add_argument(
        "--relay-threads",
        action="store_true",
        help="each relay on a thread and loop of its own (Relay's default) instead of one loop per process",
    )
    parser.add_argument(
        "--replay-parts",
        type=int,
        default=0,
        help="capture the load through --relays relays in this many parts, then replay it "
        "all at once into the aggregator (bench/scale/replay.py)",
    )
    parser.add_argument(
        "--capture-dir",
        type=Path,
        default=None,
        help="--replay-parts: keep the capture here, or replay the one kept here",
    )
    parser.add_argument(
        "--relay-processes", action="store_true", help="one real relay process per node"
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--find-max", action="store_true")
    mode.add_argument("--overload", action="store_true", help="check memory vs queue bound")
    mode.add_argument("--soak", action="store_true", help="10 minutes, RSS/fd/thread samples")
    mode.add_argument("--pause", action="store_true", help="SIGSTOP the aggregator mid-run")
    parser.add_argument("--queue-batches", type=int, default=None, help="export queue bound")
    parser.add_argument("--queue-bytes", type=int, default=None, help="export queue bound")
    parser.add_argument(
        "--queue-trace", type=Path, default=None, help="queue depth, drops, GC CPU s every 50 ms"
    )
    parser.add_argument("--probes", type=int, default=8)
    parser.add_argument("--probe-seconds", type=float, default=20.0)
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--pause-at", type=float, default=5.0)
    parser.add_argument("--pause-s", type=float, default=5.0)
    args = parser.parse_args(argv)

    args.bounds = QueueBounds(args.queue_batches, args.queue_bytes, args.queue_trace)
    if args.soak and args.seconds == 60.0:
        args.seconds = 600.0
    rpn = min(args.ranks_per_node, args.ranks)
    if args.ranks % rpn:
        parser.error("--ranks must be a multiple of --ranks-per-node")
    files = parse_export_streams(args.streams)
    wire = tuple(s for s in WIRE_ORDER if s in batch_streams_for(files))
    spec = LoadSpec(
        ranks=args.ranks,
        steps_per_s=args.steps_per_s,
        seconds=args.seconds,
        ranks_per_node=rpn,
        gpus=args.gpus,
        flush_hz=args.flush_hz,
        sampler_interval_s=args.sampler_interval,
        wire_streams=wire,
        sender_buffer_bytes=args.sender_buffer_kib * 1024,
    )
    tmp = None
    if args.logs_dir is None:
        tmp = tempfile.mkdtemp(prefix="traceml-scale-")
        logs_dir = Path(tmp)
    else:
        logs_dir = args.logs_dir.resolve()
        logs_dir.mkdir(parents=True, exist_ok=True)
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    try:
        if args.summarize:
            print_profile(args.summarize)
        elif args.find_max:
            find_max(args, spec, logs_dir)
        elif args.soak:
            soak(args, spec, logs_dir)
        elif args.overload:
            overload(args, spec, logs_dir)
        elif args.pause:
            pause(args, spec, logs_dir)
        elif args.replay_parts:
            if not args.relays:
                parser.error("--replay-parts needs --relays")
            r = run_replay(
                spec,
                args.streams,
                logs_dir=logs_dir,
                run_name="scale",
                parts=args.replay_parts,
                relays=args.relays,
                relay_procs=args.relay_procs,
                procs=args.procs,
                bounds=args.bounds,
                do_validate=not args.no_validate,
                capture_dir=args.capture_dir,
            )
            print(final_line(r, r.records_per_s if r.sustained else 0))
        else:
            hosts: RelayHosts | RelayProcesses | None = None
            if args.relay_processes:
                hosts = RelayProcesses()
            elif args.relays:
                hosts = RelayHosts(args.relays, args.relay_procs, not args.relay_threads)
            r = run_once(
                spec,
                args.streams,
                logs_dir=logs_dir,
                run_name="scale",
                procs=args.procs,
                bounds=args.bounds,
                do_validate=not args.no_validate,
                during=py_spy(args.py_spy, spec.seconds) if args.py_spy else None,
                route=(
                    (lambda address, token: hosts.route(address, token, spec.nodes))
                    if hosts is not None
                    else None
                ),
                after_load=hosts.stop if hosts is not None else None,
            )
            if args.py_spy:
                summarize_profile(args.py_spy)
            if isinstance(hosts, RelayHosts):
                how = "a thread each" if args.relay_threads else "one loop per process"
                print(f"relays: {args.relays} in {hosts.procs} processes ({how}): {hosts.totals}")
            elif hosts is not None:
                print(f"relays: {hosts.relays} relay processes, one per node: {hosts.totals}")
            print(final_line(r, r.records_per_s if r.sustained else 0))
    finally:
        print(f"machine: load average {os.getloadavg()[0]:.2f} at end")
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)
