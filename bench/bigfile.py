"""A realistic step_time export of any size, written fast, for the benches that read files.

A 64-rank GPU run (8 nodes of 8): each line is one step of one rank, with the
built-in phases (the DataLoader on the CPU, H2D copy, forward, backward, optimizer,
the whole step on the rank's GPU) and user phases (``trace_phase``), timings as CUDA
events and ``perf_counter`` give them (float32 device times, nanosecond host times).
Ranks flush a few steps per batch, so lines arrive in short runs per rank, as the
aggregator writes them; the closing line ends the file.

The bytes are the real encoder's (``dumps_line``): a pool of records is encoded once
and each line splices its own timestamps, ``seq`` and ``step`` into one of them, so
writing costs about a string join per line, and the disk's write speed bounds it.

With ``collectives``, a collectives file alongside: one line per step of each rank,
DDP's gradient all-reduce in backward (``ddp_comm_hook``, NCCL, the wait measured on
the device), the step's end and sequence spliced in as the step_time line's.

    from bench.bigfile import write_step_time
    size = write_step_time(path, 1_000_000)  # 64 ranks, 6 built-in + 2 user phases
    write_step_time(path, 1_000_000, collectives=path.with_name("collectives.jsonl"))

``write_process`` writes the sampler streams of a run: process.jsonl (one line per
rank every 2 s, the rate of the default sampler), and for each of those snapshots
system.jsonl (one line per node) and system_gpu.jsonl (one line per GPU of each node);
1,024 ranks write about 1.8 million process lines an hour.

    python -m bench.bigfile OUT.jsonl [--lines N] [--world 64] [--collectives FILE]
        [--process N]   (N process lines, and their system files, beside OUT.jsonl)
"""

from __future__ import annotations

import argparse
import random
import struct
import time
from collections.abc import Sequence
from pathlib import Path

from traceml_records import ClosingLine, PhaseTiming, StepTimeRecord, dumps_line
from traceml_records._generated.records import (
    CollectivesRecord,
    ProcessRecord,
    SystemGpuRecord,
    SystemRecord,
)

_P = "_traceml_internal:"

USER_PHASES: tuple[str, ...] = ("compute_loss", "grad_clip")
"""The user phases every step has by default (names as ``trace_phase`` gives them)."""

# Typical share of a ~60 ms step of a 64-GPU data-parallel job, per phase (ms).
_BUILTIN_MS = {
    "backward_time": 28.0,
    "forward_time": 14.0,
    "h2d_time": 0.8,
    "optimizer_step": 4.5,
}
_USER_MS = 1.6
_LOADER_MS = 2.2
_STEP_OVERHEAD_MS = 3.0
_POOL = 512  # encoded event variants per local rank
_STEP_NS = 60_000_000
_BATCH_STEPS = 4  # steps a rank flushes per batch


def _f32(ms: float) -> float:
    """``ms`` as CUDA's ``elapsed_time`` gives it (a float32, widened)."""
    value: float = struct.unpack("f", struct.pack("f", ms))[0]
    return value


def _gpu(rnd: random.Random, ms: float, device: str) -> dict[str, PhaseTiming]:
    gpu = _f32(ms * rnd.uniform(0.9, 1.15))
    cpu = round(gpu + rnd.uniform(0.02, 0.4), 6)  # host time, nanosecond resolution
    return {device: PhaseTiming(cpu_ms=cpu, duration_ms=gpu, gpu_ms=gpu, is_gpu=True, n_calls=1)}


def _cpu(rnd: random.Random, ms: float) -> dict[str, PhaseTiming]:
    cpu = round(ms * rnd.uniform(0.5, 2.0), 6)
    return {"cpu": PhaseTiming(cpu_ms=cpu, duration_ms=cpu, gpu_ms=None, is_gpu=False, n_calls=1)}


def _events(
    rnd: random.Random, device: str, user_phases: Sequence[str]
) -> dict[str, dict[str, PhaseTiming]]:
    events = {_P + name: _gpu(rnd, ms, device) for name, ms in _BUILTIN_MS.items()}
    events[_P + "dataloader_next"] = _cpu(rnd, _LOADER_MS)
    for name in user_phases:
        events[name] = _gpu(rnd, _USER_MS, device)
    total = sum(t.duration_ms for timing in events.values() for t in timing.values())
    events[_P + "step_time"] = _gpu(rnd, total + _STEP_OVERHEAD_MS, device)
    return events


# Values no real field takes, so each is found exactly once in an encoded line.
_SENTINELS = (7_111_111_111_111_111_117, 7_222_222_222_222_222_227, 7_333_333_337, 7_444_444_447)


def _templates(
    world: int, ranks_per_node: int, user_phases: Sequence[str], seed: int
) -> tuple[list[list[bytes]], list[list[bytes]]]:
    """Per rank: the line's head cut at the four varying fields; per local rank: the
    encoded ``events`` values, each ending the line."""
    rnd = random.Random(seed)
    marker = b'"events":'

    def encode(rank: int) -> tuple[bytes, bytes]:
        """The line of ``rank`` with fresh timings, cut after ``"events":``."""
        local = rank % ranks_per_node
        line = dumps_line(
            StepTimeRecord(
                observed_timestamp_unix_ns=_SENTINELS[0],
                rank=rank,
                global_rank=rank,
                local_rank=local,
                world_size=world,
                local_world_size=ranks_per_node,
                node_rank=rank // ranks_per_node,
                timestamp_unix_ns=_SENTINELS[1],
                seq=_SENTINELS[2],
                step=_SENTINELS[3],
                events=_events(rnd, f"cuda:{local}", user_phases),
            )
        )
        cut = line.index(marker) + len(marker)
        return line[:cut], line[cut:]

    tails = [[encode(local)[1] for _ in range(_POOL)] for local in range(ranks_per_node)]
    heads: list[list[bytes]] = []
    for rank in range(world):
        head = encode(rank)[0]
        parts: list[bytes] = []
        for sentinel in _SENTINELS:
            before, head = head.split(str(sentinel).encode())
            parts.append(before)
        parts.append(head)
        heads.append(parts)
    return heads, tails


_WAIT_POOL = 4099  # wait values (a prime, so they never line up with the steps)


def _collectives_heads(world: int, ranks_per_node: int) -> list[list[bytes]]:
    """Per rank: a collectives line cut at its four varying fields (the sentinels) and
    its wait."""
    heads: list[list[bytes]] = []
    wait_sentinel = 7_555.555_5
    for rank in range(world):
        line = dumps_line(
            CollectivesRecord(
                observed_timestamp_unix_ns=_SENTINELS[0],
                rank=rank,
                global_rank=rank,
                local_rank=rank % ranks_per_node,
                world_size=world,
                local_world_size=ranks_per_node,
                node_rank=rank // ranks_per_node,
                timestamp_unix_ns=_SENTINELS[1],
                seq=_SENTINELS[2],
                step=_SENTINELS[3],
                phase=_P + "backward_time",
                op="all_reduce",
                source="ddp_comm_hook",
                backend="nccl",
                n_calls=25,
                wait_ms=wait_sentinel,
                wait_measure="device",
                first_arrival_ms=0.41,
                last_arrival_ms=27.9,
            )
        )
        parts: list[bytes] = []
        for sentinel in (*_SENTINELS, wait_sentinel):
            before, line = line.split(str(sentinel).encode())
            parts.append(before)
        parts.append(line)
        heads.append(parts)
    return heads


def write_step_time(
    path: Path,
    lines: int,
    *,
    world: int = 64,
    ranks_per_node: int = 8,
    user_phases: Sequence[str] = USER_PHASES,
    seed: int = 0,
    collectives: Path | None = None,
) -> int:
    """Write ``lines`` step_time lines of a ``world``-rank run, then its closing line.

    Rank ``r`` is ``local_rank = r % ranks_per_node`` on node ``r // ranks_per_node``;
    steps go round the ranks in batches of a few steps each, so every (rank, step) is
    written once and the file passes ``traceml validate``. With ``collectives``, that
    file gets one collectives line per step line (the same rank, step, end and
    sequence; a wait of 1 to 9 ms). Returns the step_time file's size.
    """
    if world % ranks_per_node:
        raise ValueError(f"world {world} is not a multiple of ranks_per_node {ranks_per_node}")
    heads, tails = _templates(world, ranks_per_node, user_phases, seed)
    rnd = random.Random(seed + 1)
    picks = [rnd.randrange(_POOL) for _ in range(4099)]  # a prime cycle of pool indexes
    t0 = 1_796_073_447_453_688_073
    block = world * _BATCH_STEPS
    written = 0
    coll_heads = _collectives_heads(world, ranks_per_node) if collectives is not None else []
    waits = [f"{rnd.uniform(1.0, 9.0):.6f}".encode() for _ in range(_WAIT_POOL)]
    coll_fh = open(collectives, "wb") if collectives is not None else None  # noqa: SIM115
    coll: list[bytes] = []
    with open(path, "wb") as fh:
        out: list[bytes] = []
        for start in range(0, lines, block):
            first_step = start // world + 1
            for rank in range(world):
                h0, h1, h2, h3, h4 = heads[rank]
                pool = tails[rank % ranks_per_node]
                jitter = rank * 37_011
                for k in range(_BATCH_STEPS):
                    i = start + rank * _BATCH_STEPS + k
                    if i >= lines:
                        break
                    step = first_step + k
                    ts = t0 + step * _STEP_NS + jitter
                    observed = t0 + (first_step + _BATCH_STEPS) * _STEP_NS + jitter + 70_000
                    out += (
                        h0,
                        str(observed).encode(),
                        h1,
                        str(ts).encode(),
                        h2,
                        str(step - 1).encode(),
                        h3,
                        str(step).encode(),
                        h4,
                        pool[picks[i % 4099]],
                    )
                    if coll_heads:
                        c0, c1, c2, c3, c4, c5 = coll_heads[rank]
                        coll += (
                            c0,
                            str(observed).encode(),
                            c1,
                            str(ts).encode(),
                            c2,
                            str(step - 1).encode(),
                            c3,
                            str(step).encode(),
                            c4,
                            waits[i % _WAIT_POOL],
                            c5,
                        )
            if len(out) > 100_000:
                written += fh.write(b"".join(out))
                out.clear()
            if coll_fh is not None and len(coll) > 100_000:
                coll_fh.write(b"".join(coll))
                coll.clear()
        closing = ClosingLine(stream="step_time", written_records=lines, dropped_batches=0)
        out.append(dumps_line(closing))
        written += fh.write(b"".join(out))
    if coll_fh is not None:
        with coll_fh:
            closing = ClosingLine(stream="collectives", written_records=lines, dropped_batches=0)
            coll.append(dumps_line(closing))
            coll_fh.write(b"".join(coll))
    return written


_SAMPLE_NS = 2_000_000_000  # one sampler snapshot every 2 s
_CPU_SENTINEL, _HOST_SENTINEL = 7_555.555_5, 55.555_51
_GPU_SENTINELS = (66.666_51, 61.123_4, 612.345_6)


def _cut(line: bytes, sentinels: Sequence[object]) -> list[bytes]:
    """``line`` cut at each sentinel, in order (the pieces between them)."""
    parts: list[bytes] = []
    for sentinel in sentinels:
        before, line = line.split(str(sentinel).encode())
        parts.append(before)
    parts.append(line)
    return parts


def write_process(
    folder: Path,
    lines: int,
    *,
    world: int = 1024,
    ranks_per_node: int = 8,
    seed: int = 0,
) -> dict[str, int]:
    """Write ``lines`` process lines of a ``world``-rank run into ``folder`` (snapshot
    after snapshot, every rank in each), and the system and system_gpu lines of as many
    snapshots (one per node, one per GPU: ``ranks_per_node`` GPUs a node), each file
    with its closing line. Returns each file's line count."""
    if world % ranks_per_node:
        raise ValueError(f"world {world} is not a multiple of ranks_per_node {ranks_per_node}")
    rnd = random.Random(seed)
    nodes = world // ranks_per_node
    ident = (_SENTINELS[0], _SENTINELS[1], _SENTINELS[2])

    def identity(rank: int) -> dict[str, object]:
        return {
            "observed_timestamp_unix_ns": _SENTINELS[0],
            "rank": rank,
            "global_rank": rank,
            "local_rank": rank % ranks_per_node,
            "world_size": world,
            "local_world_size": ranks_per_node,
            "node_rank": rank // ranks_per_node,
            "hostname": f"node-{rank // ranks_per_node:03d}",
            "timestamp_unix_ns": _SENTINELS[1],
            "seq": _SENTINELS[2],
        }

    process = [
        _cut(
            dumps_line(
                ProcessRecord(
                    **identity(rank),  # type: ignore[arg-type]
                    pid=10_000 + rank,
                    cpu_percent=_CPU_SENTINEL,
                    cpu_logical_cores=96,
                    ram_used_bytes=_SENTINELS[3],
                    ram_total_bytes=2 << 40,
                    gpu_available=True,
                    gpu_count=ranks_per_node,
                    gpu_device_index=rank % ranks_per_node,
                    gpu_memory_used_bytes=_SENTINELS[3] + 2,
                    gpu_memory_reserved_bytes=_SENTINELS[3] + 4,
                    gpu_memory_total_bytes=80 << 30,
                )
            ),
            (*ident, _CPU_SENTINEL, _SENTINELS[3], _SENTINELS[3] + 2, _SENTINELS[3] + 4),
        )
        for rank in range(world)
    ]
    system = [
        _cut(
            dumps_line(
                SystemRecord(
                    **identity(node * ranks_per_node),  # type: ignore[arg-type]
                    cpu_percent=_HOST_SENTINEL,
                    ram_used_bytes=_SENTINELS[3],
                    ram_total_bytes=2 << 40,
                    gpu_available=True,
                    gpu_count=ranks_per_node,
                )
            ),
            (*ident, _HOST_SENTINEL, _SENTINELS[3]),
        )
        for node in range(nodes)
    ]
    gpus = [
        [
            _cut(
                dumps_line(
                    SystemGpuRecord(
                        **identity(node * ranks_per_node),  # type: ignore[arg-type]
                        gpu_index=index,
                        utilization_percent=_GPU_SENTINELS[0],
                        memory_used_bytes=_SENTINELS[3],
                        memory_total_bytes=80 << 30,
                        temperature_c=_GPU_SENTINELS[1],
                        power_usage_w=_GPU_SENTINELS[2],
                        power_limit_w=700.0,
                    )
                ),
                (*ident, _GPU_SENTINELS[0], _SENTINELS[3], *_GPU_SENTINELS[1:]),
            )
            for index in range(ranks_per_node)
        ]
        for node in range(nodes)
    ]
    pool = 4099  # values in a prime cycle, so they never line up with the ranks
    cpu = [f"{rnd.uniform(20.0, 400.0):.1f}".encode() for _ in range(pool)]
    pct = [f"{rnd.uniform(0.0, 100.0):.1f}".encode() for _ in range(pool)]
    ram = [str(rnd.randrange(4 << 30, 64 << 30)).encode() for _ in range(pool)]
    gpu_mem = [str(rnd.randrange(8 << 30, 80 << 30)).encode() for _ in range(pool)]
    temp = [f"{rnd.uniform(35.0, 85.0):.1f}".encode() for _ in range(pool)]
    power = [f"{rnd.uniform(80.0, 700.0):.2f}".encode() for _ in range(pool)]
    t0 = 1_796_073_447_453_688_073
    counts = {"process": 0, "system": 0, "system_gpu": 0}
    names = ("process", "system", "system_gpu")
    files = [open(folder / f"{name}.jsonl", "wb") for name in names]  # noqa: SIM115
    outs: list[list[bytes]] = [[], [], []]
    i = 0
    try:
        for snap in range((lines + world - 1) // world):
            seq = str(snap).encode()
            out, sys_out, gpu_out = outs
            for rank in range(min(world, lines - snap * world)):
                ts = str(t0 + snap * _SAMPLE_NS + rank * 37_011).encode()
                observed = str(t0 + snap * _SAMPLE_NS + rank * 37_011 + 90_000).encode()
                p0, p1, p2, p3, p4, p5, p6, p7 = process[rank]
                k = i % pool
                out += (p0, observed, p1, ts, p2, seq, p3, cpu[k], p4, ram[k], p5)
                out += (gpu_mem[k], p6, gpu_mem[(k + 7) % pool], p7)
                i += 1
            counts["process"] += min(world, lines - snap * world)
            for node in range(nodes):
                ts = str(t0 + snap * _SAMPLE_NS + node * 8_001).encode()
                observed = str(t0 + snap * _SAMPLE_NS + node * 8_001 + 90_000).encode()
                k = (i + node) % pool
                s0, s1, s2, s3, s4, s5 = system[node]
                sys_out += (s0, observed, s1, ts, s2, seq, s3, pct[k], s4, ram[k], s5)
                for index in range(ranks_per_node):
                    g0, g1, g2, g3, g4, g5, g6, g7 = gpus[node][index]
                    k = (i + node * ranks_per_node + index) % pool
                    gpu_out += (g0, observed, g1, ts, g2, seq, g3, pct[k], g4, gpu_mem[k])
                    gpu_out += (g5, temp[k], g6, power[k], g7)
            counts["system"] += nodes
            counts["system_gpu"] += nodes * ranks_per_node
            for fh, pending in zip(files, outs, strict=True):
                if len(pending) > 100_000:
                    fh.write(b"".join(pending))
                    pending.clear()
        for name, fh, pending in zip(names, files, outs, strict=True):
            closing = ClosingLine(stream=name, written_records=counts[name], dropped_batches=0)
            pending.append(dumps_line(closing))
            fh.write(b"".join(pending))
    finally:
        for fh in files:
            fh.close()
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path)
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--world", type=int, default=64)
    parser.add_argument(
        "--collectives", type=Path, default=None, help="also write this collectives file"
    )
    parser.add_argument(
        "--process",
        type=int,
        default=0,
        help="also write this many process lines (and their system files) beside the file",
    )
    args = parser.parse_args()
    if args.process:
        start = time.perf_counter()
        counts = write_process(args.path.parent, args.process, world=args.world)
        shown = ", ".join(f"{n:,} {name}" for name, n in counts.items())
        print(f"wrote {shown} lines in {time.perf_counter() - start:.1f} s")
    start = time.perf_counter()
    size = write_step_time(args.path, args.lines, world=args.world, collectives=args.collectives)
    took = time.perf_counter() - start
    print(
        f"wrote {args.lines:,} lines, {size / 1e6:,.0f} MB ({size / max(args.lines, 1):.0f} "
        f"bytes a line) in {took:.1f} s: {args.path}"
    )


if __name__ == "__main__":
    main()
