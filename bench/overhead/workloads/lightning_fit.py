"""Training script of ``bench.overhead.frameworks``: a PyTorch Lightning ``fit``.

The model is examples/lightning_fit.py's small MLP on random data, one CPU thread, no
validation, one batch per optimizer update. argv[1]: the output file; argv[2]:
optimizer updates; argv[3]: k, given to ``update_clock.trace_one_update_in`` (one
update in k traced; under ``TRACEML_ZERO_CODE=0`` nothing is). The clock is the start
of each training batch (the epoch loop's ``advance``, wrapped on this trainer outside
TraceML's own wraps), so each interval holds one whole update: its DataLoader fetch,
every hook, and TraceML's begin and end of it. Writes ``{"durations", "cpu",
"traced"}``: per interval, wall seconds, the training thread's CPU seconds, and whether
TraceML's hooks were on at its start.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import orjson
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from update_clock import StartClock, trace_one_update_in


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


def main() -> None:
    out_path, steps, one_in = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trace_one_update_in(one_in)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # 255 batches an epoch: the slow first batch of each epoch falls on every position
    # of the bench's traced-one-in-k cycle in turn (bench.overhead.paired).
    x = torch.randn(8160, 32, generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=32)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    epoch_loop = trainer.fit_loop.epoch_loop
    advance = StartClock(epoch_loop.advance)
    # An instance attribute: the loop's `self.advance(...)` finds it first.
    epoch_loop.advance = advance  # type: ignore[method-assign]
    trainer.fit(Regressor(), loader)
    with open(out_path, "wb") as f:
        f.write(orjson.dumps(advance.result()))


if __name__ == "__main__":
    main()
