"""Training loop of ``bench.overhead.step --paired``: traced and untraced steps take turns.

One process under ``traceml run``: step i is traced when i % k == 0. Each step fetches
its batch from a DataLoader (inside the timed window, as a training loop does) and
runs forward, backward and the optimizer on an MLP sized for a step of roughly
600 µs on one CPU thread. Writes one JSON object to argv[1]: per step, whether it was
traced, its duration in seconds (wall) and the training thread's CPU seconds.
argv[2]: seconds to run; argv[3]: k; argv[4] ``null`` (optional): TraceML is never
started and no step is traced, the steps still flagged in turns (the A/A run of
``bench.overhead.paired``, and the no-TraceML baseline of the whole cost).
"""

from __future__ import annotations

import contextlib
import sys
import time

import orjson
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml_ai as traceml

out_path = sys.argv[1]
seconds = float(sys.argv[2])
one_in = int(sys.argv[3])
null = len(sys.argv) > 4 and sys.argv[4] == "null"
torch.set_num_threads(1)
torch.manual_seed(0)
model = nn.Sequential(
    nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1)
)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
loss_fn = nn.MSELoss()
# 63 batches an epoch: the slow first batch of each epoch falls on every position of
# the traced-one-in-4 cycle in turn, not always on the traced step (bench.overhead.paired).
data = TensorDataset(torch.randn(4032, 256), torch.randn(4032, 1))
loader = DataLoader(data, batch_size=64, shuffle=True, drop_last=True)
if not null:
    traceml.init()


def batches() -> object:
    while True:
        yield from loader


untraced = contextlib.nullcontext()
it = iter(batches())  # type: ignore[call-overload]
traced_flags: list[bool] = []
durations: list[float] = []
# The training thread's CPU time per step too: on a busy machine the wall time of a
# step also counts the time other processes held the core.
cpu: list[float] = []
thread_time = time.thread_time
end = time.monotonic() + seconds
i = 0
while time.monotonic() < end:
    traced = i % one_in == 0
    t0 = time.perf_counter()
    c0 = thread_time()
    x, y = next(it)
    with traceml.trace_step(model) if traced and not null else untraced:
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()
    durations.append(time.perf_counter() - t0)
    cpu.append(thread_time() - c0)
    traced_flags.append(traced)
    i += 1
if not null:
    traceml.shutdown()
with open(out_path, "wb") as f:
    # traceml_file: which TraceML ran (bench.overhead.step prints it, so a baseline run
    # with PYTHONPATH=<old tree>/src can be seen to run the old code).
    f.write(
        orjson.dumps(
            {
                "traced": traced_flags,
                "durations": durations,
                "cpu": cpu,
                "traceml_file": traceml.__file__,
            }
        )
    )
