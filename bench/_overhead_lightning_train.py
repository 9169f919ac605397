"""Training script of bench/overhead_frameworks.py: a PyTorch Lightning ``fit``.

Unpaired, it knows nothing about TraceML (the bench runs it under ``traceml run``, with the
zero-code attach on or off). The model is examples/lightning_fit.py's small MLP on
random data, one CPU thread, no validation, one batch per optimizer update. A
callback of its own takes the time at the end of every training batch; writes
``{"durations": [...], "cpu": [...]}`` to argv[1]: wall seconds and training-thread
CPU seconds between consecutive batch ends.
argv[2]: optimizer updates.

argv[3] ``paired`` (bench/overhead_frameworks.py's default mode): TraceML's benchmark
switch ``traceml_ai.integrations._common.ALTERNATE`` makes every other update untraced,
and the clock is the start of each training batch (the epoch loop's ``advance``,
wrapped on this trainer outside TraceML's own wraps, so each interval holds one whole
update: its DataLoader fetch, every hook, and TraceML's begin and end of it). Adds
``"traced"``: per interval, whether TraceML's hooks were on at its start.
"""

from __future__ import annotations

import itertools
import sys
import time
from typing import Any

import lightning.pytorch as pl
import orjson
import torch
from _overhead_clock import StartClock
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.net(x)
        return out

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class BatchClock(pl.Callback):
    """The time at the end of each training batch (independent of TraceML)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def on_train_batch_end(self, *args: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())
        # The training thread's CPU time: what other processes on a busy machine
        # do not inflate (wall time counts the time this thread was not running).
        self.cpu_ends.append(time.thread_time())


def main() -> None:
    out_path, steps = sys.argv[1], int(sys.argv[2])
    paired = len(sys.argv) > 3 and sys.argv[3] == "paired"
    if paired:
        from traceml_ai.integrations import _common

        _common.ALTERNATE = True
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(8192, 32, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    clock = BatchClock()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[] if paired else [clock],
    )
    if paired:
        epoch_loop = trainer.fit_loop.epoch_loop
        advance = StartClock(epoch_loop.advance)
        # An instance attribute: the loop's `self.advance(...)` finds it first.
        epoch_loop.advance = advance  # type: ignore[method-assign]
    trainer.fit(Regressor(), loader)
    with open(out_path, "wb") as f:
        if paired:
            result = {
                "durations": _gaps(advance.ends),
                "cpu": _gaps(advance.cpu_ends),
                "traced": advance.traced[:-1],
            }
        else:
            result = {"durations": _gaps(clock.ends), "cpu": _gaps(clock.cpu_ends)}
        f.write(orjson.dumps(result))


def _gaps(ends: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(ends)]


if __name__ == "__main__":
    main()
