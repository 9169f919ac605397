"""Training script of ``bench.overhead.frameworks``: a Hugging Face ``Trainer`` run.

The model is examples/hf_trainer.py's: a 2-layer GPT-2 built from a config, trained on
random tokens on one CPU thread, no evaluation. argv[1]: the output file; argv[2]:
optimizer updates; argv[3]: k, given to ``update_clock.trace_one_update_in`` (one
update in k traced; under ``TRACEML_ZERO_CODE=0`` nothing is). The clock is the start of each update
(``Trainer.get_batch_samples``, which fetches its batches, wrapped on this trainer),
so each interval holds one whole update: its DataLoader fetch, every callback, and
TraceML's begin and end of it. Writes ``{"durations", "cpu", "traced"}``: per interval,
wall seconds, the training thread's CPU seconds, and whether TraceML's hooks were on
at its start.
"""

from __future__ import annotations

import os
import sys

from update_clock import StartClock, trace_one_update_in

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import orjson
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
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


def main() -> None:
    out_path, steps, one_in = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    trace_one_update_in(one_in)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=256, n_positions=32,
        bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
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
    )
    fetch = StartClock(trainer.get_batch_samples)
    # An instance attribute: the training loop's `self.get_batch_samples(...)` finds it
    # first.
    trainer.get_batch_samples = fetch  # type: ignore[method-assign]
    trainer.train()
    with open(out_path, "wb") as f:
        f.write(orjson.dumps(fetch.result()))


if __name__ == "__main__":
    main()
