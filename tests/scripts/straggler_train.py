"""A tiny DDP run (gloo, CPU) where chosen ranks are slowed in one chosen place.

The straggler tests (tests/traceml_ai/analysis/test_straggler.py) run it under ``traceml run``
and check that the summary names the slowed ranks, the place and where the others wait.

Usage: straggler_train.py --where WHERE [--slow-ranks 1,3] [--every N] [--sleep-ms MS]
       [--steps N] [--strategy ddp|fsdp2|allreduce] [--exit-after N] [--work-ms MS]

WHERE is one of: none, forward, backward, optimizer, collate (the DataLoader's
collate_fn, the batch fetched before the step opens), dataloader_in_step (the batch
fetched inside the step), between (work after the step, before the next batch).
``--every N`` slows only every Nth iteration (1: every one). ``--work-ms MS``: every rank
sleeps MS at the start of each forward (0: none), so that the steps are long against a
busy machine's scheduling delays, as real steps are.

``--strategy``: ``ddp`` (DistributedDataParallel, the default), ``fsdp2`` (every layer
and the root under ``fully_shard``: all-gathers in forward and backward, reduce-scatters
in backward), ``allreduce`` (no wrapper: the script averages the gradients itself with
``dist.all_reduce`` after backward). Under fsdp2 and allreduce, ``forward`` and
``backward`` slow one middle layer's forward or backward computation.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from typing import Any

# The collector walks every object torch makes, again and again while torch (and, in
# DistributedDataParallel's constructor, torch._dynamo) imports, and at exit: about a
# second of a rank's CPU, paid by every rank of every straggler run on 2 shared cores.
# It is off until training starts, and what exists by then is frozen out of its walks
# (main()); the steps run with the collector on.
gc.disable()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import traceml_ai as traceml  # noqa: E402

WHERE = ("none", "forward", "backward", "optimizer", "collate", "dataloader_in_step", "between")


class _Clock:
    """Whether this rank sleeps in the current iteration."""

    def __init__(self, slow: bool, every: int, sleep_s: float) -> None:
        self.slow, self.every, self.sleep_s = slow, every, sleep_s
        self.iteration = 0

    def pause(self) -> None:
        if self.slow and self.iteration % self.every == 0:
            time.sleep(self.sleep_s)


class _SleepInBackward(torch.autograd.Function):
    clock: _Clock | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _SleepInBackward.clock is not None:
            _SleepInBackward.clock.pause()
        return grad


class _Model(nn.Module):
    def __init__(self, clock: _Clock, where: str) -> None:
        super().__init__()
        self.first = nn.Linear(16, 32)
        self.second = nn.Linear(32, 1)
        self.clock, self.where = clock, where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.where == "forward":
            self.clock.pause()
        h = torch.relu(self.first(x))
        if self.where == "backward":
            h = _SleepInBackward.apply(h)
        return self.second(h)


class _Layer(nn.Module):
    """One block; the slowed one sleeps in its forward, or in its backward."""

    def __init__(self, clock: _Clock | None, where: str) -> None:
        super().__init__()
        self.linear = nn.Linear(32, 32)
        self.clock, self.where = clock, where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.clock is not None and self.where == "forward":
            self.clock.pause()
        h = torch.relu(self.linear(x))
        if self.clock is not None and self.where == "backward":
            h = _SleepInBackward.apply(h)
        return h


class _Deep(nn.Module):
    """Four blocks between an input and an output layer; the third is the slow one."""

    def __init__(self, clock: _Clock, where: str) -> None:
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([_Layer(clock if i == 2 else None, where) for i in range(4)])
        self.out = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h)


class _SlowSGD(torch.optim.SGD):
    """SGD whose step sleeps (inside the step torch's optimizer hooks time)."""

    clock: _Clock | None = None

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if self.clock is not None:
            self.clock.pause()
        return super().step(closure)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--where", choices=WHERE, required=True)
    parser.add_argument("--slow-ranks", default="1")
    parser.add_argument("--every", type=int, default=1)
    parser.add_argument("--sleep-ms", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--strategy", choices=("ddp", "fsdp2", "allreduce"), default="ddp")
    parser.add_argument(
        "--exit-after", type=int, default=0, help="the slowed ranks os._exit(0) after N steps"
    )
    parser.add_argument("--work-ms", type=float, default=0.0)
    args = parser.parse_args()
    traceml.init()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)
    slow_ranks = {int(r) for r in args.slow_ranks.split(",") if r}
    slow = args.where != "none" and rank in slow_ranks
    clock = _Clock(slow, max(1, args.every), args.sleep_ms / 1000)
    _SleepInBackward.clock = clock

    def collate(batch: list[tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, torch.Tensor]:
        if args.where in ("collate", "dataloader_in_step"):
            clock.pause()
        xs, ys = zip(*batch, strict=True)
        return torch.stack(xs), torch.stack(ys)

    data = TensorDataset(torch.randn(args.steps * 8, 16), torch.randn(args.steps * 8, 1))
    loader = DataLoader(data, batch_size=8, collate_fn=collate)
    model: nn.Module
    if args.strategy == "ddp":
        model = _Model(clock, args.where)
        if args.work_ms > 0:
            model.register_forward_pre_hook(lambda *_: time.sleep(args.work_ms / 1000))
        if world > 1:
            model = nn.parallel.DistributedDataParallel(model)
    else:
        model = _Deep(clock, args.where)
        if args.work_ms > 0:
            model.register_forward_pre_hook(lambda *_: time.sleep(args.work_ms / 1000))
        if args.strategy == "fsdp2" and world > 1:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (world,))
            for block in model.blocks:  # type: ignore[union-attr]
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
    opt = _SlowSGD(model.parameters(), lr=0.01)
    opt.clock = clock if args.where == "optimizer" else None

    def train_step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        if args.strategy == "allreduce" and world > 1:
            for p in model.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad)
                    p.grad /= world
        opt.step()

    gc.freeze()
    gc.enable()
    it = iter(loader)
    for i in range(1, args.steps + 1):
        clock.iteration = i
        if args.where == "dataloader_in_step":
            with traceml.trace_step(model):
                x, y = next(it)
                train_step(x, y)
        else:
            x, y = next(it)
            with traceml.trace_step(model):
                train_step(x, y)
        if args.where == "between":
            clock.pause()
        if args.exit_after and slow and i == args.exit_after:
            os._exit(0)  # a rank that stops early: no shutdown, no goodbye
    traceml.shutdown()
    if world > 1:
        dist.barrier()
        del model, opt
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
