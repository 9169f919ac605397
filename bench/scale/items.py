"""What a simulated rank sends: its wire items and the load it generates."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from traceml_ai.testing import make_gpu_entry, make_identity, make_item, make_phase

WIRE_ORDER = (
    "runtime_environment",
    "step_time",
    "step_memory",
    "collectives",
    "process",
    "system",
)


# -- what a rank sends ------------------------------------------------------------------


def _gpu_timing(ms: float) -> dict[str, Any]:
    return make_phase(ms * 0.2, ms)


def step_events(device: str) -> dict[str, Any]:
    """The phases of one GPU step as the rank SDK reports them."""
    return {
        "_traceml_internal:dataloader_next": {"cpu": make_phase(3.7009716033935547)},
        "_traceml_internal:forward_time": {device: _gpu_timing(8.20612907409668)},
        "_traceml_internal:backward_time": {device: _gpu_timing(15.316009521484375)},
        "_traceml_internal:optimizer_step": {device: _gpu_timing(0.5419254302978516)},
        "_traceml_internal:step_time": {device: _gpu_timing(27.03070640563965)},
    }


def collectives_item(seq: int, ts: int) -> dict[str, Any]:
    """A DDP rank's collectives line for step ``seq + 1``, as ``rank/_collectives``
    records it: its gradient buckets' all-reduces in backward, timed on the device."""
    return {
        "timestamp_unix_ns": ts,
        "seq": seq,
        "step": seq + 1,
        "phase": "_traceml_internal:backward_time",
        "op": "all_reduce",
        "source": "ddp_comm_hook",
        "backend": "nccl",
        "n_calls": 4,
        "wait_ms": 6.123779296875,
        "wait_measure": "device",
        "first_arrival_ms": 4.0218505859375,
        "last_arrival_ms": 14.876220703125,
        "group": "dp",
        "peer_rank": None,
        "peer_stage": None,
        "bytes": 102_228_128,
    }


# The figures of a busy 8-GPU node, kept as the earlier runs of this benchmark sent
# them (docs/benchmarks.md compares runs): same items, same bytes.


def process_item(seq: int, ts: int, local_rank: int) -> dict[str, Any]:
    return make_item(
        "process",
        seq,
        device=f"cuda:{local_rank % 8}",
        timestamp_unix_ns=ts,
        cpu_percent=101.5,
        ram_used_bytes=3_123_456_789,
        gpu_count=8,
        gpu_memory_used_bytes=30 * 10**9,
        gpu_memory_reserved_bytes=32 * 10**9,
        gpu_uuid=None,
    )


def system_item(seq: int, ts: int, gpus: int) -> dict[str, Any]:
    entries = [make_gpu_entry(i, memory_used_bytes=30 * 10**9, gpu_uuid=None) for i in range(gpus)]
    return make_item("system", seq, n_gpus=gpus, timestamp_unix_ns=ts, gpus=entries)


def runtime_item(ts: int, world_size: int, local_world_size: int) -> dict[str, Any]:
    identity = make_identity(world_size=world_size, local_world_size=local_world_size)
    return make_item(
        "runtime_environment",
        0,
        identity=identity,
        timestamp_unix_ns=ts,
        distributed_initialized=True,
        distributed_backend="nccl",
        training_strategy="ddp",
    )


@dataclass(frozen=True)
class LoadSpec:
    """What the simulated job sends."""

    ranks: int
    steps_per_s: float
    seconds: float
    ranks_per_node: int = 8
    gpus: int = 8
    flush_hz: float = 4.0
    sampler_interval_s: float = 2.0
    wire_streams: tuple[str, ...] = WIRE_ORDER
    sender_buffer_bytes: int = 4 * 2**20

    @property
    def nodes(self) -> int:
        return self.ranks // self.ranks_per_node

    @property
    def total_steps(self) -> int:
        return round(self.steps_per_s * self.seconds)

    @property
    def total_samples(self) -> int:
        return max(1, math.ceil(self.seconds / self.sampler_interval_s))

    def identity(self, rank: int) -> dict[str, Any]:
        return {
            "global_rank": rank,
            "local_rank": rank % self.ranks_per_node,
            "world_size": self.ranks,
            "local_world_size": self.ranks_per_node,
            "node_rank": rank // self.ranks_per_node,
            "hostname": f"node-{rank // self.ranks_per_node:04d}",
            "pid": 100_000 + rank,
        }
