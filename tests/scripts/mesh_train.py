"""A tiny 2-D DeviceMesh run (gloo, CPU): 2 data-parallel replicas x 2 tensor-parallel ranks.

Run under ``traceml run --nproc-per-node 4``. The mesh is
``init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))``: global rank g is
``dp = g // 2``, ``tp = g % 2`` (tp varies fastest: the layout ``tp=2,dp=2`` in the
``parallel`` setting's order)::

    replica 0: ranks 0 (tp 0), 1 (tp 1)
    replica 1: ranks 2 (tp 0), 3 (tp 1)

Each block of the MLP is tensor-parallel over the mesh's tp dimension
(``parallelize_module``: ``ColwiseParallel`` on its up projection, ``RowwiseParallel``
on its down projection, so every block's forward ends in an all-reduce over tp and
its backward in one too). ``--strategy fsdp2`` (the default) shards each block and
the root with ``fully_shard(mesh=mesh["dp"])`` (all-gathers in forward and backward,
reduce-scatters in backward, over dp); ``--strategy allreduce`` leaves the
parameters whole and averages the gradients over dp with ``dist.all_reduce`` on each
DTensor's local shard after backward.

Usage: mesh_train.py [--strategy fsdp2|allreduce] [--slow-rank R] [--sleep-ms MS]
       [--steps N]

``--slow-rank R`` (default -1: none) makes global rank R sleep ``--sleep-ms`` in the
forward of the second (last) block each step: its tp peer waits in that block's
all-reduce, the other replica in the next dp collective.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import traceml_ai as traceml

HIDDEN = 16


class _Block(nn.Module):
    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.up = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.down = nn.Linear(4 * HIDDEN, HIDDEN)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        out: torch.Tensor = self.down(torch.relu(self.up(x)))
        return out


class _MLP(nn.Module):
    def __init__(self, slow_s: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block(slow_s if i == 1 else 0.0) for i in range(2)])
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        out: torch.Tensor = self.head(x)
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("fsdp2", "allreduce"), default="fsdp2")
    parser.add_argument("--slow-rank", type=int, default=-1)
    parser.add_argument("--sleep-ms", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    traceml.init()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != 4:
        raise SystemExit(f"mesh_train.py needs 4 ranks (dp=2 x tp=2); got {world}")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same initial weights on every rank
    torch.set_num_threads(1)
    slow_s = args.sleep_ms / 1000 if rank == args.slow_rank else 0.0
    model = _MLP(slow_s)
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    if args.strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    dp_group = mesh.get_group("dp")
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    # Ranks of one replica see the same batch (tensor parallel), replicas their own.
    gen = torch.Generator().manual_seed(100 + mesh.get_local_rank("dp"))
    for _ in range(args.steps):
        x = torch.randn(8, HIDDEN, generator=gen)
        y = torch.randn(8, 1, generator=gen)
        with traceml.trace_step(model):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()  # type: ignore[no-untyped-call,unused-ignore]
            if args.strategy == "allreduce":
                for p in model.parameters():
                    if p.grad is None:
                        continue
                    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
                    dist.all_reduce(grad, group=dp_group)
                    grad /= 2
            opt.step()
    traceml.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
