"""A Hugging Face ``Trainer`` run that TraceML traces with no code change.

The script knows nothing about TraceML. Launched with ``traceml run``, every
optimizer update of ``trainer.train()`` becomes one step_time line per rank:

    traceml run --exporter jsonl --export-streams all examples/hf_trainer.py
    traceml run --nproc-per-node 2 --exporter jsonl examples/hf_trainer.py --grad-accum 4

A 2-layer GPT-2 is built from a config and trained on random tokens on the CPU, so
nothing is downloaded. Evaluation runs every few updates; it is not a training step
and is left out of step_time. Needs ``pip install 'traceml-ai[hf]'``.

Launched without ``traceml run``, add the callback yourself (see docs/integrations.md):
``Trainer(..., callbacks=[TraceMLTrainerCallback()])``.
"""

from __future__ import annotations

import argparse
import os

# The model is built from a config: nothing to download, so stay offline.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class RandomTokens(torch.utils.data.Dataset):
    """Fixed random token sequences; the labels are the inputs (language modelling)."""

    def __init__(self, samples: int, length: int, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.tokens = torch.randint(0, vocab, (samples, length), generator=generator)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[index], "labels": self.tokens[index]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="optimizer updates")
    parser.add_argument("--grad-accum", type=int, default=2, help="micro-batches per update")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--eval-every", type=int, default=10, help="updates between evaluations")
    parser.add_argument("--output-dir", default="hf_trainer_output")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = GPT2Config(
        n_layer=2,
        n_embd=64,
        n_head=2,
        vocab_size=256,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
    )
    model = GPT2LMHeadModel(config)
    training_args = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        gradient_accumulation_steps=args.grad_accum,
        eval_strategy="steps",
        eval_steps=args.eval_every,
        learning_rate=1e-3,
        use_cpu=True,
        # gloo for DDP on the CPU, only under a launcher (traceml run, torchrun): given
        # without one, transformers asks for a process group that does not exist.
        ddp_backend="gloo" if "WORLD_SIZE" in os.environ else None,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=RandomTokens(2048, 32, config.vocab_size, seed=0),
        eval_dataset=RandomTokens(32, 32, config.vocab_size, seed=1),
    )
    trainer.train()


if __name__ == "__main__":
    main()
