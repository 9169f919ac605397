"""Traced steps with and without the collective timing, paired in one process.

Run under ``traceml run --nproc-per-node 2`` by ``bench.overhead.collectives``. Every
step is traced; in turns, the collectives are timed or not:

- ``ddp``: two identical DDP models, one whose buckets go through TraceML's
  communication hook (made while the collective timing is on) and one with DDP's own
  C++ all-reduce (made while it is off); the steps alternate between them;
- ``fsdp2``: one ``fully_shard`` model (five sharded modules); the collective timing is
  switched on and off between steps (off, its patches only pass through).

Rank 0 writes ``{"on_us": [...], "off_us": [...], "collectives": n}`` to ``OUT``:
per-pair step times in microseconds and the collectives of one timed step.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import traceml_ai as traceml
from traceml_ai.rank import _collectives


def _model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(64, 256), nn.ReLU()]
    for _ in range(3):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    layers.append(nn.Linear(256, 1))
    return nn.Sequential(*layers)


def main() -> None:
    strategy, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    traceml.init()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    recorder = _collectives.active()
    assert recorder is not None, "TraceML's collective timing is not active"
    x, y = torch.randn(32, 64), torch.randn(32, 1)
    if strategy == "ddp":
        on_model = nn.parallel.DistributedDataParallel(_model())
        on_model(x)  # the first forward gives it TraceML's hook
        _collectives.activate(None)
        off_model = nn.parallel.DistributedDataParallel(_model())
        off_model(x)  # no hook: DDP's own all-reduce
        _collectives.activate(recorder)
        models = {True: on_model, False: off_model}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        model = _model()
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for layer in model:
            if isinstance(layer, nn.Linear) and layer.in_features == 256:
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        models = {True: model, False: model}
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3) for k, m in models.items()}

    def step(on: bool) -> float:
        _collectives.activate(recorder if on else None)
        model, opt = models[on], opts[on]
        t0 = time.perf_counter_ns()
        with traceml.trace_step(model):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return (time.perf_counter_ns() - t0) / 1e3

    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(steps):
        on = i % 2 == 0
        times[on].append(step(on))
    # One more timed step, its collectives counted from its items (not in the figures).
    counted = [0]
    sink = recorder._sink
    last = recorder._timer.step + 1

    class Counting:
        def put(self, stream: str, item: dict[str, object]) -> None:
            if stream == "collectives" and item["step"] == last:
                counted[0] += int(item["n_calls"])  # type: ignore[call-overload]
            sink.put(stream, item)

    recorder._sink = Counting()  # type: ignore[assignment]
    step(True)
    step(True)  # its items are built once a later step ended
    recorder._timer.build_ended()
    recorder._sink = sink
    traceml.shutdown()
    if dist.get_rank() == 0:
        with open(out, "w") as fh:
            json.dump({"on_us": times[True], "off_us": times[False], "collectives": counted[0]}, fh)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
