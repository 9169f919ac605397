"""A tiny 3D-style run (gloo, CPU): 2 data-parallel replicas x 2 pipeline stages.

Run under ``traceml run --nproc-per-node 4 --parallel dp=2,pp=2`` (or
``TRACEML_PARALLEL=dp=2,pp=2``). The layout is Megatron's order with the first
dimension varying fastest: global rank g is replica ``dp = g % 2`` at stage
``pp = g // 2``::

    stage 0: ranks 0 (replica 0), 1 (replica 1)
    stage 1: ranks 2 (replica 0), 3 (replica 1)

Each replica is a two-stage pipeline with ``--microbatches`` microbatches:
``--pipeline torch`` (the default) uses ``torch.distributed.pipelining`` (a
``PipelineStage`` per rank over the replica's pp group, ``ScheduleGPipe`` or
``Schedule1F1B`` by ``--schedule``); ``--pipeline manual`` is GPipe written by hand
(every forward, each sending its activation with ``dist.send``, then every backward,
each gradient sent back with ``dist.send``; the peer blocks in ``dist.recv``; both
over the replica's pp group, the peer named by its global rank).
After the step's backwards,
each stage averages its gradients over its dp group with one flat ``all_reduce``
(the way DDP's bucket would) and steps its optimizer. Every step is a
``traceml.trace_step(stage_module)``.

The compute is sleeps (steady on two busy cores): every microbatch sleeps
``--forward-ms`` in the stage's forward and ``--backward-ms`` in its backward.

Usage: parallel_train.py [--case none|slow_stage|slow_rank|data_imbalance] [--steps N]
       [--slow-rank R] [--sleep-ms MS] [--stage-extra-ms MS] [--seed S]

``--case``:

- ``none``: every rank alike.
- ``slow_stage``: the last stage does ``--stage-extra-ms`` more per microbatch in its
  forward and as much more in its backward, on every replica (about twice the compute).
- ``slow_rank``: rank ``--slow-rank`` (default 1) sleeps ``--sleep-ms`` more per step,
  in the forward of its first microbatch.
- ``data_imbalance``: each step, each replica draws a sequence length (seeded by seed,
  step and replica: both stages of a replica draw the same) between 64 and 256; the
  compute of its microbatches scales with length / 128, and the step's tokens
  (microbatch rows x length, summed) go to ``trace_step(model, tokens=...)`` when
  TraceML has that keyword. The slowest replica changes from step to step.
"""

from __future__ import annotations

import argparse
import inspect
import os
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import traceml_ai as traceml

CASES = ("none", "slow_stage", "slow_rank", "data_imbalance")
DP, PP = 2, 2
HIDDEN = 16
MIN_LEN, MAX_LEN, REF_LEN = 64, 256, 128


def seq_len(seed: int, step: int, replica: int) -> int:
    """The sequence length replica ``replica`` draws in ``step`` (the same on its stages)."""
    return random.Random(f"{seed}/{step}/{replica}").randint(MIN_LEN, MAX_LEN)


class _Work:
    """The sleeps of this rank: per microbatch, plus the extra ones of the case."""

    def __init__(self, forward_s: float, backward_s: float) -> None:
        self.forward_s, self.backward_s = forward_s, backward_s
        self.scale = 1.0
        self.first_extra_s = 0.0  # once per step, in the first microbatch's forward
        self._pending_extra = 0.0

    def start_step(self, scale: float) -> None:
        self.scale = scale
        self._pending_extra = self.first_extra_s

    def forward(self) -> None:
        time.sleep(self.forward_s * self.scale + self._pending_extra)
        self._pending_extra = 0.0

    def backward(self) -> None:
        time.sleep(self.backward_s * self.scale)


class _SleepInBackward(torch.autograd.Function):
    work: _Work | None = None

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        if _SleepInBackward.work is not None:
            _SleepInBackward.work.backward()
        return grad


class _Stage(nn.Module):
    """One pipeline stage: two linear layers, the stage's sleeps around them."""

    def __init__(self, work: _Work) -> None:
        super().__init__()
        self.first = nn.Linear(HIDDEN, HIDDEN)
        self.second = nn.Linear(HIDDEN, HIDDEN)
        self.work = work

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.work.forward()
        h = torch.relu(self.first(x))
        h = _SleepInBackward.apply(h)  # type: ignore[no-untyped-call,unused-ignore]
        out: torch.Tensor = self.second(h)
        return out


def _tokens_keyword() -> bool:
    """Whether this TraceML's ``trace_step`` takes ``tokens=``."""
    try:
        return "tokens" in inspect.signature(traceml.trace_step).parameters
    except (TypeError, ValueError):
        return False


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(out, target)


class _ManualGPipe:
    """GPipe by hand over two stages: all forwards, then all backwards, blocking p2p."""

    def __init__(
        self, model: nn.Module, stage_index: int, peer: int, group: Any, microbatches: int
    ) -> None:
        self.model, self.stage_index, self.peer = model, stage_index, peer
        self.group, self.microbatches = group, microbatches

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        m = self.microbatches
        if self.stage_index == 0:
            outs = self._forward_sending(x.chunk(m))
            for out in outs:
                grad = torch.empty_like(out)
                dist.recv(grad, src=self.peer, group=self.group)
                torch.autograd.backward(out, grad)  # type: ignore[no-untyped-call,unused-ignore]
        else:
            inputs, losses = [], []
            for target in y.chunk(m):
                inp = torch.empty(target.shape[0], HIDDEN)
                dist.recv(inp, src=self.peer, group=self.group)
                inp.requires_grad_(True)
                inputs.append(inp)
                losses.append(_loss(self.model(inp), target) / m)
            for inp, loss in zip(inputs, losses, strict=True):
                torch.autograd.backward(loss)  # type: ignore[no-untyped-call,unused-ignore]
                assert inp.grad is not None
                dist.send(inp.grad, dst=self.peer, group=self.group)

    def _forward_sending(self, chunks: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        """Stage 0's forwards, each activation sent as soon as it is computed."""
        outs = []
        for chunk in chunks:
            out = self.model(chunk)
            dist.send(out.detach(), dst=self.peer, group=self.group)
            outs.append(out)
        return outs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, default="none")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--pipeline", choices=("torch", "manual"), default="torch")
    parser.add_argument("--schedule", choices=("gpipe", "1f1b"), default="gpipe")
    parser.add_argument("--forward-ms", type=float, default=2.0)
    parser.add_argument("--backward-ms", type=float, default=2.0)
    parser.add_argument("--stage-extra-ms", type=float, default=4.0)
    parser.add_argument("--slow-rank", type=int, default=1)
    parser.add_argument("--sleep-ms", type=float, default=30.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    traceml.init()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != DP * PP:
        raise SystemExit(f"parallel_train.py needs {DP * PP} ranks (dp=2,pp=2); got {world}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    replica, stage_index = rank % DP, rank // DP

    # Every rank creates every group, in the same order (new_group is collective).
    pp_groups = [dist.new_group([d + s * DP for s in range(PP)]) for d in range(DP)]
    dp_groups = [dist.new_group([d + s * DP for d in range(DP)]) for s in range(PP)]
    pp_group, dp_group = pp_groups[replica], dp_groups[stage_index]

    last = stage_index == PP - 1
    extra = args.stage_extra_ms if args.case == "slow_stage" and last else 0.0
    work = _Work((args.forward_ms + extra) / 1000, (args.backward_ms + extra) / 1000)
    if args.case == "slow_rank" and rank == args.slow_rank:
        work.first_extra_s = args.sleep_ms / 1000
    _SleepInBackward.work = work

    model = _Stage(work)
    run_step: Callable[[torch.Tensor, torch.Tensor], None]
    if args.pipeline == "torch":
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(model, stage_index, PP, torch.device("cpu"), group=pp_group)
        schedule_cls = ScheduleGPipe if args.schedule == "gpipe" else Schedule1F1B
        schedule = schedule_cls(stage, n_microbatches=args.microbatches, loss_fn=_loss)

        def run_step(x: torch.Tensor, y: torch.Tensor) -> None:
            if stage_index == 0:
                schedule.step(x)
            else:
                losses: list[torch.Tensor] = []
                schedule.step(target=y, losses=losses)

    else:
        peer = replica + (1 - stage_index) * DP
        run_step = _ManualGPipe(model, stage_index, peer, pp_group, args.microbatches).step
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    params = list(model.parameters())
    with_tokens = _tokens_keyword()

    rows = 2 * args.microbatches
    gen = torch.Generator().manual_seed(1000 + replica)
    for step in range(1, args.steps + 1):
        length = seq_len(args.seed, step, replica) if args.case == "data_imbalance" else REF_LEN
        work.start_step(length / REF_LEN)
        # Both stages of a replica draw the same batch (the first feeds x, the last y).
        x = torch.randn(rows, HIDDEN, generator=gen)
        y = torch.randn(rows, HIDDEN, generator=gen)
        ctx: AbstractContextManager[None]
        if with_tokens and args.case == "data_imbalance":
            ctx = traceml.trace_step(model, tokens=rows * length)  # type: ignore[call-arg,unused-ignore]
        else:
            ctx = traceml.trace_step(model)
        with ctx:
            opt.zero_grad()
            run_step(x, y)
            # Data parallel: one flat all_reduce of the stage's gradients over its replicas.
            flat = torch.cat(
                [
                    (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    for p in params
                ]
            )
            dist.all_reduce(flat, group=dp_group)
            flat /= DP
            offset = 0
            for p in params:
                n = p.numel()
                p.grad = flat[offset : offset + n].view_as(p).clone()
                offset += n
            opt.step()
    traceml.shutdown()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
