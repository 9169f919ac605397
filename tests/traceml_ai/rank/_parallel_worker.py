"""One rank of the parallel-layout tests (tests/traceml_ai/rank/test_parallel.py): a real
gloo process group on CPU, TraceML with an in-memory sink, the scenario's collectives;
what the sink got is written as JSON to ``<out>/<rank>.json``.

``python _parallel_worker.py SCENARIO RANK WORLD PORT OUT``
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import traceml_ai as traceml
from traceml_ai.rank.sink import RecordingSink


def main() -> None:
    scenario, rank, world, port, out = sys.argv[1:6]
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=rank, WORLD_SIZE=world,
        LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
    )  # fmt: skip
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=0.2)
    dist.init_process_group("gloo", rank=int(rank), world_size=int(world))
    model = torch.nn.Linear(4, 4)
    if scenario == "mesh":
        from torch.distributed.device_mesh import init_device_mesh

        with traceml.trace_step(model, tokens=7):
            pass  # the first item: before the mesh
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with traceml.trace_step(model):
            traceml.record_tokens(5)
            traceml.record_tokens(6)
            dist.all_reduce(torch.ones(8), group=mesh.get_group("tp"))
            dist.all_reduce(torch.ones(4), group=mesh.get_group("dp"))
            dist.all_reduce(torch.ones(2))
            dist.all_reduce(torch.ones(2), dist.ReduceOp.SUM, dist.group.WORLD)
    elif scenario == "declared":
        with traceml.trace_step(model):
            dist.all_reduce(torch.ones(3))
    elif scenario == "megatron":
        import megatron.core.parallel_state as ps

        # 4 ranks, Megatron's order tp-cp-ep-dp-pp: tp 1, dp 2, pp 2.
        ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2)
        with traceml.trace_step(model):
            dist.all_reduce(torch.ones(4), group=ps.get_data_parallel_group())
            dist.all_reduce(torch.ones(2), group=ps.get_pipeline_model_parallel_group())
    elif scenario == "pipeline":
        me = int(rank)
        with traceml.trace_step(model):
            if me == 0:
                dist.send(torch.ones(10), dst=1)
                ops = [dist.P2POp(dist.isend, torch.ones(6), 1)]
            else:
                dist.recv(torch.empty(10), src=0)
                ops = [dist.P2POp(dist.irecv, torch.empty(6), 0)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
    import time

    time.sleep(0.6)  # a sampler tick: a layout found after the first item is sent again
    dist.barrier()
    traceml.shutdown()
    result: dict[str, Any] = {
        name: sink.items(name) for name in ("runtime_environment", "collectives", "step_time")
    }
    with open(os.path.join(out, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
