"""A tiny DDP run (gloo, CPU) where one rank is slowed inside its forward pass.

Used by tests/traceml_ai/test_summary.py: the summary must name that rank as the
straggler,
and the fast rank should show the wait inside backward (DDP's all-reduce).
Usage: slow_rank_train.py [--steps N] [--slow-rank R] [--sleep-ms MS]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import traceml_ai as traceml


class _Slowed(nn.Module):
    """A linear layer whose forward sleeps on one rank (the straggler)."""

    def __init__(self, sleep_s: float) -> None:
        super().__init__()
        self.inner = nn.Linear(8, 1)
        self.sleep_s = sleep_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return self.inner(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--sleep-ms", type=float, default=20.0)
    args = parser.parse_args()
    traceml.init()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    sleep_s = args.sleep_ms / 1000 if rank == args.slow_rank else 0.0
    model: nn.Module = _Slowed(sleep_s)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8)
    y = torch.randn(4, 1)
    for _ in range(args.steps):
        with traceml.trace_step(model):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    traceml.shutdown()
    if world > 1:
        dist.barrier()
        del model, opt
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
