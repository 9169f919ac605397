"""A tiny model, its data and the rank environment, shared by the rank SDK tests."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from traceml_ai.rank._timing import event_names, step_timer
from traceml_ai.rank.sink import RecordingSink

ENV_VARS = (
    "TRACEML_AGGREGATOR_ADDR",
    "TRACEML_RUN_TOKEN",
    "TRACEML_SAMPLER_INTERVAL",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "NODE_RANK",
)
"""What a launcher sets for a rank; the tests remove them so ``init`` runs standalone."""


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))


def make_loader(steps: int, batch: int = 4) -> DataLoader[Any]:
    torch.manual_seed(1)
    return DataLoader(
        TensorDataset(torch.randn(steps * batch, 8), torch.randn(steps * batch, 1)),
        batch_size=batch,
    )


def step_items(sink: RecordingSink) -> list[dict[str, Any]]:
    return sink.items("step_time")


class TensorlessModel:
    """No tensors: a timer puts its steps on ``cpu`` (or the FakeCuda's model device)."""

    def parameters(self) -> Any:
        return iter(())

    def buffers(self) -> Any:
        return iter(())


def timer_steps(timer: step_timer.StepTimer, n: int, model: object) -> None:
    """``n`` steps of a timer driven by hand, each with one DataLoader wait before it."""
    for _ in range(n):
        timer.add_host(event_names.DATALOADER_NEXT, 1000)
        timer.begin(model)
        timer.end()
