"""An Accelerate training loop traced by TraceML: one step per optimizer update.

    traceml run --exporter jsonl --export-streams all examples/accelerate_loop.py
    traceml run --nproc-per-node 2 --exporter jsonl examples/accelerate_loop.py --grad-accum 4

The loop uses ``traceml_ai.integrations.accelerate.accumulate(accelerator, model)``
where it would use ``accelerator.accumulate(model)``: with ``--grad-accum k`` the k
micro-batches fold into one traced step. The evaluation loop runs inside
``evaluation()`` so its batches are not counted toward the next training step.
Needs ``pip install 'traceml-ai[hf]'``.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml_ai as traceml
from traceml_ai.integrations.accelerate import accumulate, evaluation


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()

    # Before the first batch is fetched, so the first step's DataLoader wait counts.
    traceml.init()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=args.grad_accum)
    torch.manual_seed(0)
    x = torch.randn(4096, 32)
    data = TensorDataset(x, x.sum(dim=1, keepdim=True))
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model,
        optimizer,
        DataLoader(data, batch_size=args.batch_size, shuffle=True),
        DataLoader(data, batch_size=256),
    )

    for epoch in range(args.epochs):
        model.train()
        for inputs, targets in train_loader:
            with accumulate(accelerator, model):
                loss = nn.functional.mse_loss(model(inputs), targets)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
        model.eval()
        with evaluation(), torch.no_grad():
            total = sum(float(nn.functional.mse_loss(model(i), t)) for i, t in eval_loader)
        accelerator.print(f"epoch {epoch}: eval loss {total / len(eval_loader):.4f}")


if __name__ == "__main__":
    main()
