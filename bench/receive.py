"""The aggregator's receive path for a relay's connection, per frame, in process.

A relay forwards the frames of its node's ranks over one connection, several to a
chunk. This feeds such chunks (``--frames`` one-step step_time batches of 8 ranks to
a chunk, as a relay's connection carries them at 2,048 ranks: 4.7 a read) to a real
``AggregatorServer`` connection's ``data_received``, its batches handed to a bounded
queue as the aggregator's export takes them, and prints the CPU time per frame (least
of ``--repeat`` measurements): this tree with its C extensions, this tree in pure
Python (``TRACEML_PURE_PYTHON=1``), and with ``--baseline PATH`` another checkout
(e.g. a ``git worktree`` of the commit before), each in its own process, taking turns
``--rounds`` times. Last line: ``receive_us_per_frame=<this tree, median>
pure_us_per_frame=<median>`` and, with a baseline, ``baseline_us_per_frame=<median>
receive_ratio=<this over baseline>``.

    python -m bench.receive --baseline ../before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

TOKEN = "t" * 43


def measure(frames_per_chunk: int, reads: int, repeat: int) -> float:
    """µs of CPU per frame through ``data_received`` (least of ``repeat``)."""
    import orjson

    from traceml_ai._queue import BoundedBatchQueue
    from traceml_ai.transport.server import AggregatorServer, Connection
    from traceml_ai.transport.wire import FRAME_HEADER, make_batch_message

    from .scale.items import LoadSpec, step_events

    spec = LoadSpec(ranks=8, steps_per_s=1, seconds=1)
    frames = []
    for rank in range(8):
        item = {"timestamp_unix_ns": 1, "seq": 0, "step": 1, "events": step_events("cuda:0")}
        body = orjson.dumps(make_batch_message(TOKEN, spec.identity(rank), "step_time", [item]))
        frames.append(FRAME_HEADER.pack(len(body)) + body)
    chunks = [b"".join(frames[i : i + frames_per_chunk]) for i in range(8 - frames_per_chunk + 1)]
    queue: BoundedBatchQueue[Any] = BoundedBatchQueue(max_items=10**9, max_bytes=10**12)
    put_many = getattr(queue, "put_many", None)
    if put_many is not None:  # a tree whose server hands each read's batches on together
        server = AggregatorServer(
            "127.0.0.1", 0, TOKEN, queue.put, lambda m: None, on_batches=put_many
        )
    else:
        server = AggregatorServer("127.0.0.1", 0, TOKEN, queue.put, lambda m: None)

    class Transport:
        def is_closing(self) -> bool:
            return False

        def close(self) -> None:
            pass

    connection = Connection(server)
    connection._transport = Transport()  # type: ignore[assignment]
    # As after the relay's first frame: trusted, and read as a relay's connection.
    connection._trusted = connection._proven = True
    connection.rank = "relay:bench"
    connection.handle = server._relayed_frame
    connection.relayed = True  # this tree's flag (an older tree has none and ignores it)
    best = float("inf")
    for _ in range(repeat):
        started = time.process_time()
        for i in range(reads):
            connection.data_received(chunks[i % len(chunks)])
        best = min(best, (time.process_time() - started) / (reads * frames_per_chunk) * 1e6)
        with queue.cond:
            taken = len(queue.take_all())
        if taken != reads * frames_per_chunk:  # every frame must have been a batch handed on
            raise RuntimeError(f"{taken} of {reads * frames_per_chunk} frames queued")
    return best


def _run(root: Path, args: argparse.Namespace, pure: bool) -> float:
    env = dict(os.environ, PYTHONPATH=f"{root / 'src'}{os.pathsep}{Path(__file__).parent.parent}")
    env.pop("TRACEML_PURE_PYTHON", None)
    if pure:
        env["TRACEML_PURE_PYTHON"] = "1"
    cmd = [
        sys.executable,
        "-m",
        "bench.receive",
        "--one",
        f"--frames={args.frames}",
        f"--reads={args.reads}",
        f"--repeat={args.repeat}",
    ]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return float(json.loads(done.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--frames", type=int, default=5, help="frames a chunk (1-8)")
    parser.add_argument("--reads", type=int, default=40000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not 1 <= args.frames <= 8:
        parser.error("--frames: from 1 to 8")
    if args.one:
        print(json.dumps(measure(args.frames, args.reads, args.repeat)))
        return
    here = Path(__file__).resolve().parent.parent
    runs: dict[str, list[float]] = {"this": [], "pure": [], "baseline": []}
    for _ in range(args.rounds):
        runs["this"].append(_run(here, args, pure=False))
        runs["pure"].append(_run(here, args, pure=True))
        if args.baseline is not None:
            runs["baseline"].append(_run(args.baseline.resolve(), args, pure=False))
        print(" ".join(f"{name}={v[-1]:.3f}" for name, v in runs.items() if v), flush=True)
    mine = statistics.median(runs["this"])
    line = (
        f"receive_us_per_frame={mine:.3f} pure_us_per_frame={statistics.median(runs['pure']):.3f}"
    )
    if args.baseline is not None:
        base = statistics.median(runs["baseline"])
        line += f" baseline_us_per_frame={base:.3f} receive_ratio={mine / base:.3f}"
    print(line)


if __name__ == "__main__":
    main()
