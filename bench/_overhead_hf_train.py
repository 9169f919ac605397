"""Training script of bench/overhead_frameworks.py: a Hugging Face ``Trainer`` run.

Unpaired, it knows nothing about TraceML (the bench runs it under ``traceml run``, with the
zero-code attach on or off). The model is examples/hf_trainer.py's: a 2-layer GPT-2
built from a config, trained on random tokens on one CPU thread, no evaluation.
A callback of its own takes the time at the end of every optimizer update; writes
``{"durations": [...], "cpu": [...]}`` to argv[1]: wall seconds and training-thread
CPU seconds between consecutive update ends.
argv[2]: optimizer updates.

argv[3] ``paired`` (bench/overhead_frameworks.py's default mode): TraceML's benchmark
switch ``traceml_ai.integrations._common.ALTERNATE`` makes every other update untraced,
and the clock is the start of each update (``Trainer.get_batch_samples``, which fetches
its batches, wrapped on this trainer), so each interval holds one whole update: its
DataLoader fetch, every callback, and TraceML's begin and end of it. Adds
``"traced"``: per interval, whether TraceML's hooks were on at its start.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
from typing import Any

from _overhead_clock import StartClock

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import orjson
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)


class RandomTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, samples: int, length: int, vocab: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.tokens = torch.randint(0, vocab, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


class UpdateClock(TrainerCallback):
    """The time at the end of each optimizer update (independent of TraceML)."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.cpu_ends: list[float] = []

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.ends.append(time.perf_counter())
        # The training thread's CPU time: what other processes on a busy machine
        # do not inflate (wall time counts the time this thread was not running).
        self.cpu_ends.append(time.thread_time())


def main() -> None:
    out_path, steps = sys.argv[1], int(sys.argv[2])
    paired = len(sys.argv) > 3 and sys.argv[3] == "paired"
    if paired:
        from traceml_ai.integrations import _common

        _common.ALTERNATE = True
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    clock = UpdateClock()
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=TrainingArguments(
            output_dir=os.path.join(os.path.dirname(out_path), "hf_output"),
            max_steps=steps,
            per_device_train_batch_size=8,
            learning_rate=1e-3,
            use_cpu=True,
            report_to="none",
            save_strategy="no",
            logging_strategy="no",
            eval_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
        ),
        train_dataset=RandomTokens(4096, 32, config.vocab_size),
        callbacks=[] if paired else [clock],
    )
    if paired:
        fetch = StartClock(trainer.get_batch_samples)
        # An instance attribute: the training loop's `self.get_batch_samples(...)`
        # finds it first.
        trainer.get_batch_samples = fetch  # type: ignore[method-assign]
    trainer.train()
    with open(out_path, "wb") as f:
        if paired:
            result = {
                "durations": _gaps(fetch.ends),
                "cpu": _gaps(fetch.cpu_ends),
                "traced": fetch.traced[:-1],
            }
        else:
            result = {"durations": _gaps(clock.ends), "cpu": _gaps(clock.cpu_ends)}
        f.write(orjson.dumps(result))


def _gaps(ends: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(ends)]


if __name__ == "__main__":
    main()
