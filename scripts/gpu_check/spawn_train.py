"""The spawn-workers workload of the GPU check, written the way users write scripts.

    traceml run --exporter jsonl --export-streams all ... spawn_train.py RESULT_JSON [--cpu]

``traceml.init()`` is called at the top of the file, and the DataLoader starts its
workers with ``spawn``: each worker re-imports this file (as ``__mp_main__``), so the
top-level ``init()`` runs again there. TraceML must stay off in those children: the
export must hold one process (this rank's pid) and one ``seq`` series per stream.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml_ai as traceml

traceml.init()


def main(argv: list[str]) -> int:
    result_path = argv[0]
    cuda = "--cpu" not in argv[1:]
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(512, 32), torch.randn(512, 1))
    loader = DataLoader(
        data, batch_size=32, num_workers=2, multiprocessing_context="spawn", pin_memory=cuda
    )
    steps = 0
    for x, y in loader:
        with traceml.trace_step(model):
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
        steps += 1
    if cuda:
        torch.cuda.synchronize()
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "steps": steps, "device": str(device)}, f)
    traceml.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
