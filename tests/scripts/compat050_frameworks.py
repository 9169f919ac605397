"""TraceML 0.5.0's integration names in one process (tests/traceml_ai/integrations/
test_compat050_integrations.py runs it under ``traceml run``).

``hf``: ``huggingface.init()``; ``TraceMLTrainer`` with an explicit callback too
(3 updates); ``TraceMLTrainer(traceml_enabled=False)`` (2 updates, not traced); a plain
``Trainer`` given two callbacks (2 updates). ``lightning``: ``lightning.init()``; a
Trainer with ``TraceMLCallback`` (3 updates), then one with two (2 updates).
``lightning-selective``: ``traceml.init(mode="selective", patch_dataloader=True,
patch_h2d=True)`` as 0.5.0's ``lightning.init()`` asks, then ``lightning.init()`` and a
Trainer with ``TraceMLCallback`` (3 updates). Every model is built in code: no download.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

import traceml_ai as traceml


class Pairs(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8)
        self.y = torch.randint(0, 2, (n,))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"inputs": self.x[i], "labels": self.y[i]}


class HFNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(8, 2)

    def forward(self, inputs: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        logits = self.net(inputs)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def hf() -> None:
    from transformers import Trainer, TrainingArguments

    from traceml_ai.integrations import huggingface as traceml_hf
    from traceml_ai.integrations.huggingface import TraceMLTrainer, TraceMLTrainerCallback

    config = traceml_hf.init()
    print(f"CONFIG hf {config.mode} disabled={config.disabled}", flush=True)

    def args(steps: int) -> Any:
        return TrainingArguments(
            output_dir="hf_out", per_device_train_batch_size=4, max_steps=steps,
            save_strategy="no", report_to="none", disable_tqdm=True,
            remove_unused_columns=False, use_cpu=True, logging_strategy="no",
        )  # fmt: skip

    data = Pairs(64)
    TraceMLTrainer(
        model=HFNet(), args=args(3), train_dataset=data, callbacks=[TraceMLTrainerCallback()]
    ).train()
    TraceMLTrainer(model=HFNet(), args=args(2), train_dataset=data, traceml_enabled=False).train()
    Trainer(
        model=HFNet(),
        args=args(2),
        train_dataset=data,
        callbacks=[TraceMLTrainerCallback(), TraceMLTrainerCallback()],
    ).train()


def lightning(selective: bool) -> None:
    import lightning.pytorch as pl

    from traceml_ai.integrations import lightning as traceml_lightning
    from traceml_ai.integrations.lightning import TraceMLCallback

    if selective:
        traceml.init(mode="selective", patch_dataloader=True, patch_h2d=True)
    config = traceml_lightning.init()
    print(f"CONFIG lightning {config.mode} disabled={config.disabled}", flush=True)

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = DataLoader(TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,))), 4)

    def fit(steps: int, callbacks: list[Any]) -> None:
        trainer = pl.Trainer(
            max_steps=steps, accelerator="cpu", devices=1, logger=False,
            enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, callbacks=callbacks,
        )  # fmt: skip
        trainer.fit(Net(), loader)

    fit(3, [TraceMLCallback()])
    if not selective:
        fit(2, [TraceMLCallback(), TraceMLCallback()])


if __name__ == "__main__":
    torch.manual_seed(0)
    for part in sys.argv[1:]:
        if part == "hf":
            hf()
        else:
            lightning(selective=part == "lightning-selective")
    print("DONE", flush=True)
