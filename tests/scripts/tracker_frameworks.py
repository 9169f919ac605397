"""A training script with its own tracker run, for tests/e2e/test_trackers_real.py.

``hf STEPS REPORT_TO``: an HF ``TraceMLTrainer`` with ``report_to`` the comma list
``REPORT_TO`` (HF's ``MLflowCallback`` or ``WandbCallback`` opens the run on rank 0
and logs the loss every 5 steps).
``lightning-tensorboard STEPS LOG_ROOT``: a Lightning ``Trainer`` with a
``TensorBoardLogger(LOG_ROOT, name="lit")`` logging the loss every 5 steps. Each
rank's forward sleeps 10 ms, so the run lasts a few seconds. Models are built in
code: no download.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

FORWARD_SLEEP_S = 0.01


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
        time.sleep(FORWARD_SLEEP_S)
        logits = self.net(inputs)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def hf(steps: int, report_to: list[str]) -> None:
    from transformers import TrainingArguments

    from traceml_ai.integrations.huggingface import TraceMLTrainer

    args = TrainingArguments(
        output_dir="hf_out", per_device_train_batch_size=4, max_steps=steps,
        save_strategy="no", report_to=report_to, disable_tqdm=True,
        remove_unused_columns=False, use_cpu=True, logging_steps=5,
    )  # fmt: skip
    TraceMLTrainer(model=HFNet(), args=args, train_dataset=Pairs(4 * steps)).train()


def lightning_tensorboard(steps: int, log_root: str) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.loggers import TensorBoardLogger

    from traceml_ai.integrations.lightning import TraceMLCallback

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(8, 2)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(FORWARD_SLEEP_S)
            x, y = batch
            loss = nn.functional.cross_entropy(self.net(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = TensorDataset(torch.randn(4 * steps, 8), torch.randint(0, 2, (4 * steps,)))
    trainer = pl.Trainer(
        max_steps=steps, accelerator="cpu", logger=TensorBoardLogger(log_root, name="lit"),
        log_every_n_steps=5, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[TraceMLCallback()],
    )  # fmt: skip
    trainer.fit(Net(), DataLoader(data, 4))


if __name__ == "__main__":
    torch.manual_seed(0)
    if sys.argv[1] == "hf":
        hf(int(sys.argv[2]), sys.argv[3].split(","))
    else:
        lightning_tensorboard(int(sys.argv[2]), sys.argv[3])
    print("DONE", flush=True)
