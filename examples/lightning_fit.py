"""A PyTorch Lightning run that TraceML traces with no code change.

The script knows nothing about TraceML. Launched with ``traceml run``, every
optimizer update of ``trainer.fit()`` becomes one step_time line per rank:

    traceml run --exporter jsonl --export-streams all examples/lightning_fit.py
    traceml run --nproc-per-node 2 --exporter jsonl examples/lightning_fit.py --accumulate 4

A small MLP trains on random data on the CPU (DDP with gloo when started on several
processes). The sanity check and validation are not training steps and are left out
of step_time. Needs ``pip install 'traceml-ai[lightning]'``.

Launched without ``traceml run``, add the callback yourself (see docs/integrations.md):
``Trainer(..., callbacks=[TraceMLCallback()])``.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


def random_loader(samples: int, batch_size: int, seed: int) -> DataLoader[Any]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 32, generator=generator)
    return DataLoader(TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer updates")
    parser.add_argument("--accumulate", type=int, default=2, help="batches per update")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    torch.manual_seed(0)
    # `traceml run --nproc-per-node N` starts the ranks like torchrun does.
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy="ddp" if world_size > 1 else "auto",
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=20,
        limit_val_batches=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
    )
    trainer.fit(
        Regressor(),
        random_loader(4096, args.batch_size, seed=0),
        random_loader(256, args.batch_size, seed=1),
    )


if __name__ == "__main__":
    main()
