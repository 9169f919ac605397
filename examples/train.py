"""A small CPU training run traced by TraceML.

Run it with export on (every stream):

    traceml run --exporter jsonl --export-streams all examples/train.py

or on two processes with DDP (gloo):

    traceml run --nproc-per-node 2 --exporter jsonl examples/train.py --steps 20

On GPUs, ``--device cuda`` puts each rank on ``cuda:LOCAL_RANK`` (DDP then uses NCCL):

    traceml run --nproc-per-node 2 --exporter jsonl examples/train.py --device cuda

It also runs with plain ``python examples/train.py``: TraceML then warns once and
does nothing.
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import traceml_ai as traceml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="training steps per rank")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--fail-at-step", type=int, default=0, help="raise at this step (tests)")
    parser.add_argument("--sleep-ms", type=float, default=0.0, help="extra work per step (tests)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="cpu (default), or cuda: each rank on cuda:LOCAL_RANK, DDP over NCCL",
    )
    args = parser.parse_args()

    traceml.init()
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    if world_size > 1:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    torch.manual_seed(0)

    samples = args.steps * args.batch_size * world_size
    features = torch.randn(samples, 32)
    targets = (features.sum(dim=1, keepdim=True) > 0).float()
    dataset = TensorDataset(features, targets)
    sampler = DistributedSampler(dataset, shuffle=False) if world_size > 1 else None
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, shuffle=False)

    model: nn.Module = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    if world_size > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()

    for step, (x, y) in enumerate(loader, start=1):
        with traceml.trace_step(model):
            if device.type != "cpu":
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            if args.sleep_ms:
                with traceml.trace_phase("extra_work"):
                    torch.randn(64, 64, device=device).matmul(torch.randn(64, 64, device=device))
                    __import__("time").sleep(args.sleep_ms / 1000)
        if step == args.fail_at_step:
            raise RuntimeError(f"failing on purpose at step {step}")
        if step >= args.steps:
            break

    traceml.shutdown()
    if world_size > 1:
        # Free the DDP model (it sits in reference cycles) while torch is fully alive:
        # collected only at interpreter exit, it tears down gloo state late enough that
        # rank 0 sometimes aborts ("terminate called without an active exception").
        dist.barrier()
        del model, optimizer
        gc.collect()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
