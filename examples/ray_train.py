"""A small Ray Train job (CPU, DDP over gloo) traced by TraceML.

Install the extra and run it on a local Ray cluster that this script starts:

    pip install 'traceml-ai[ray]'
    python examples/ray_train.py --workers 2 --steps 20

The export lands in ``./logs/<session_id>/aggregator/export/`` (``step_time.jsonl``
and ``step_memory.jsonl``). ``--exporter ''`` switches export off; on a running
multi-node cluster pass ``--address auto --bind-host 0.0.0.0``.
"""

from __future__ import annotations

import argparse
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch
from ray.train import RunConfig, ScalingConfig
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import traceml_ai as traceml
from traceml_ai.integrations.ray import TraceMLRayConfig, TraceMLTorchTrainer
from traceml_records import read_jsonl


def train_loop_per_worker(config: dict[str, Any]) -> dict[str, float]:
    """An ordinary Ray Train loop; only ``traceml.trace_step`` is TraceML's."""
    torch.manual_seed(0)
    samples = config["steps"] * config["batch_size"] * ray.train.get_context().get_world_size()
    features = torch.randn(samples, 32)
    targets = (features.sum(dim=1, keepdim=True) > 0).float()
    loader = ray.train.torch.prepare_data_loader(
        DataLoader(TensorDataset(features, targets), batch_size=config["batch_size"])
    )
    model = ray.train.torch.prepare_model(
        nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1))
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.BCEWithLogitsLoss()
    loss = torch.tensor(0.0)
    for x, y in loader:
        with traceml.trace_step(model):  # times forward, backward, optimizer, data wait
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
    return {"loss": float(loss)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20, help="training steps per worker")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--exporter", default="jsonl", help="'' (off), jsonl or module:factory")
    parser.add_argument("--export-streams", default="step_time,step_memory")
    parser.add_argument("--logs-dir", default="./logs")
    parser.add_argument("--session-id", default="", help="run folder name ('' = fresh id)")
    parser.add_argument("--bind-host", default="127.0.0.1", help="0.0.0.0 for multi-node")
    parser.add_argument("--address", default=None, help="Ray cluster address (default: local)")
    parser.add_argument("--storage-path", default=None, help="Ray Train storage path")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:
        ray.init(num_cpus=args.workers, include_dashboard=False)

    trainer = TraceMLTorchTrainer(
        train_loop_per_worker,
        train_loop_config={"steps": args.steps, "batch_size": args.batch_size},
        traceml_config=TraceMLRayConfig(
            exporter=args.exporter,
            export_streams=args.export_streams,
            logs_dir=args.logs_dir,
            session_id=args.session_id,
            bind_host=args.bind_host,
        ),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(storage_path=args.storage_path, name="traceml-ray-example"),
    )
    result = trainer.fit()
    print(f"final loss (rank 0): {result.return_value['loss']:.4f}")

    run = trainer.traceml_run
    if run is not None and run.run_dir is not None:
        step_time = run.run_dir / "aggregator" / "export" / "step_time.jsonl"
        if step_time.exists():
            records = list(read_jsonl(step_time))
            print(f"{step_time}: {len(records) - 1} step lines and a closing line")
    ray.shutdown()


if __name__ == "__main__":
    main()
