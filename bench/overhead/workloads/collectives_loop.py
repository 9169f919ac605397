"""Traced steps with and without the collective timing, paired in one process.

Run under ``traceml run --nproc-per-node 2`` by ``bench.overhead.collectives``. Every
step is traced; the variants take turns, every order of them in rotation (so that no
variant is always the step after another):

- ``ddp``: ``builtin``, a DDP model with DDP's own C++ all-reduce (made while the
  collective timing is off: what a run without it has); ``hook_off``, a second DDP
  model whose buckets go through TraceML's communication hook, the timing off;
  ``hook_on``, that model with the timing on;
- ``fsdp2``: one ``fully_shard`` model (five sharded modules), the collective timing
  off (``off``: its patches only pass through) or on (``on``).

Rank 0 writes, per variant, each step's wall and training-thread CPU time in
microseconds, and the collectives of one timed step, as JSON to ``OUT``.
"""

from __future__ import annotations

import itertools
import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import traceml_ai as traceml
from traceml_ai.rank._collectives import recorder as collective_recorder
from traceml_ai.rank._patches import distributed
from traceml_ai.rank._timing import event_names


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 256), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    layers.append(nn.Linear(256, 1))
    return nn.Sequential(*layers)


def direct(out: str) -> None:
    """TraceML's own work per collective, in one process (``python collectives_loop.py
    direct OUT``, a gloo world of one): a call through the patched function with the
    timing on, against the same call passed through (timing off) and the function
    itself; and the step's aggregation of its calls into items, per call."""
    import os
    import timeit

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29581")

    class Null:
        def put(self, stream: str, item: object) -> None:
            pass

    traceml.init(sink=Null(), sampler_interval=60)  # type: ignore[arg-type]
    dist.init_process_group("gloo", rank=0, world_size=1)
    recorder = distributed.active()
    assert recorder is not None

    # all_reduce's parameters, so that the recorder finds the tensor and the group
    # where it finds them in a real call.
    def bare(
        tensor: torch.Tensor, op: object = None, group: object = None, async_op: bool = False
    ) -> None:
        return None

    patched = distributed._timed("all_reduce", bare)
    tensor = torch.ones(1)
    model = nn.Linear(1, 1)
    patched(tensor)  # the backend, learned once
    n, best = 100_000, 5
    with traceml.trace_step(model):
        distributed.activate(None)
        passed = min(timeit.repeat(lambda: patched(tensor), number=n, repeat=best)) / n
        distributed.activate(recorder)
        clear = recorder._calls.clear
        timed = min(timeit.repeat(lambda: (patched(tensor), clear()), number=n, repeat=best)) / n
        plain = min(timeit.repeat(lambda: (bare(tensor), clear()), number=n, repeat=best)) / n
    calls = [
        [
            7,
            event_names.FORWARD,
            "all_gather",
            collective_recorder.SOURCE_DIST,
            time.time_ns(),
            1000,
            0,
            None,
            # group, peer, bytes (where the recorder has them)
            *[None, None, 4][: getattr(collective_recorder, "BYTES", 7) - 7],
        ]
        for _ in range(64)
    ]

    def aggregate() -> None:
        recorder._last_step = 0
        recorder._calls.extend(calls)
        recorder.step_ended(7, time.time_ns(), 10**6)

    per_call = min(timeit.repeat(aggregate, number=500, repeat=best)) / 500 / len(calls)
    traceml.shutdown()
    dist.destroy_process_group()
    with open(out, "w") as fh:
        json.dump(
            {
                "record_us": (timed - plain) * 1e6,
                "pass_through_us": (passed - plain) * 1e6,
                "aggregate_us": per_call * 1e6,
            },
            fh,
        )


def main() -> None:
    if sys.argv[1] == "direct":
        direct(sys.argv[2])
        return
    strategy, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    traceml.init()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    recorder = distributed.active()
    assert recorder is not None, "TraceML's collective timing is not active"
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    # variant -> (model, timing on)
    variants: dict[str, tuple[nn.Module, bool]]
    if strategy == "ddp":
        distributed.activate(None)
        builtin = nn.parallel.DistributedDataParallel(_model())
        builtin(x)  # no hook: DDP's own all-reduce
        distributed.activate(recorder)
        hooked = nn.parallel.DistributedDataParallel(_model())
        hooked(x)  # the first forward gives it TraceML's hook
        variants = {
            "builtin": (builtin, False),
            "hook_off": (hooked, False),
            "hook_on": (hooked, True),
        }
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear) and layer.in_features == 256:
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        variants = {"off": (model, False), "on": (model, True)}
    opts = {id(m): torch.optim.SGD(m.parameters(), lr=1e-3) for m, _ in variants.values()}

    def step(name: str) -> tuple[float, float]:
        model, on = variants[name]
        distributed.activate(recorder if on else None)
        opt = opts[id(model)]
        t0 = time.perf_counter_ns()
        c0 = time.thread_time_ns()
        with traceml.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter_ns() - t0) / 1e3, (time.thread_time_ns() - c0) / 1e3

    orders = list(itertools.permutations(variants))
    wall: dict[str, list[float]] = {name: [] for name in variants}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    for i in range(steps // len(variants)):
        for name in orders[i % len(orders)]:
            w, c = step(name)
            wall[name].append(w)
            cpu[name].append(c)
    # One more timed step, its collectives counted from its items (not in the figures).
    timed = "hook_on" if strategy == "ddp" else "on"
    counted = [0]
    sink = recorder._sink
    last = recorder._timer.step + 1

    class Counting:
        def put(self, stream: str, item: dict[str, object]) -> None:
            if stream == "collectives" and item["step"] == last:
                counted[0] += int(item["n_calls"])  # type: ignore[call-overload]
            sink.put(stream, item)

    recorder._sink = Counting()  # type: ignore[assignment]
    step(timed)
    step(timed)  # its items are built once a later step ended
    recorder._timer.build_ended()
    recorder._sink = sink
    traceml.shutdown()
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"wall_us": wall, "cpu_us": cpu, "collectives": counted[0]}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
