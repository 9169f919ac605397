"""Training loop timed by ``bench.overhead.step``: a tiny MLP, fixed work per step.

Writes one JSON object to argv[1]: the wall-clock start time of every step and its
duration. Traced (``traceml.trace_step``) when launched by ``traceml run``.
"""

from __future__ import annotations

import os
import sys
import time

import orjson
import torch
from torch import nn

import traceml_ai as traceml

out_path = sys.argv[1]
seconds = float(sys.argv[2])
traced = bool(os.environ.get("TRACEML_AGGREGATOR_ADDR"))
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 64)
y = torch.randn(32, 1)
loss_fn = nn.MSELoss()
if traced:
    traceml.init()


def step() -> None:
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()


starts: list[float] = []
durations: list[float] = []
end = time.time() + seconds
while time.time() < end:
    t0 = time.perf_counter()
    wall = time.time()
    if traced:
        with traceml.trace_step(model):
            step()
    else:
        step()
    durations.append(time.perf_counter() - t0)
    starts.append(wall)
if traced:
    traceml.shutdown()
with open(out_path, "wb") as f:
    f.write(orjson.dumps({"starts": starts, "durations": durations}))
