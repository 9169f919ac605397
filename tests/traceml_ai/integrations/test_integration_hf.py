"""TraceML with the Hugging Face ``Trainer``: zero code under ``traceml run``, and the
explicit ``TraceMLTrainerCallback``.

A 2-layer GPT-2 built from a config (no download) trains on random tokens. Importing
transformers is slow, so there are three runs, each checking several things:

- zero code, 1 process: gradient accumulation folds into one step per update,
  evaluation inside and after ``train()`` and ``predict()`` are left out, every
  stream is exported and valid;
- zero code, 2 ranks (DDP, gloo): one step per update on each rank;
- zero code, the user's code raises inside ``train()``: it propagates unchanged and
  the run is finalized;
- the benches' switch (bench/overhead/workloads/one_in_k.py): every other update traced;
- explicit callback with the automatic attach off: a hook failure is reported
  once and training continues; evaluation's batches are dropped at ``on_evaluate``;
  the user's exception still propagates.

The runs start two at a time when the module starts (the ``runs`` fixture).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e_helpers import assert_valid, export_dir
from tests.integration_helpers import (
    BACKWARD,
    DATALOADER,
    FORWARD,
    OPTIMIZER,
    STEP,
    Runs,
    RunSpec,
    assert_all_streams_closed,
    calls,
    ddp_teardown,
    describe,
    integration_failures,
    run_two_at_a_time,
    steps_by_rank,
    stream_lines,
)

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COMMON = """
import os, sys
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randint(0, 128, (n, 16), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_ids": self.x[i], "labels": self.x[i]}


def make_args(out, **kw):
    base = dict(
        output_dir=out, per_device_train_batch_size=4, per_device_eval_batch_size=4,
        report_to="none", use_cpu=True, save_strategy="no", logging_strategy="no",
        ddp_backend="gloo", dataloader_num_workers=0, disable_tqdm=True, seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128,
                                   n_positions=16, bos_token_id=0, eos_token_id=0))
"""

# No TraceML import: the launcher attaches to Trainer.train().
ZERO_CODE = (
    COMMON
    + """
args = make_args("out", gradient_accumulation_steps=int(sys.argv[1]), max_steps=int(sys.argv[2]),
                 eval_strategy="steps", eval_steps=2)
trainer = Trainer(model=model, args=args, train_dataset=Tokens(64), eval_dataset=Tokens(12, 1))
trainer.train()
trainer.evaluate()
trainer.predict(Tokens(8, 2))
sys.stdout.write(f"TRAINED {'traceml_ai' in sys.modules}\\n")  # one write per line
"""
    + ddp_teardown("trainer", "model")
)

# No TraceML import either; the user's code raises inside train() at the 3rd update.
ZERO_CODE_RAISES = (
    COMMON
    + """
class Failing(Trainer):
    def compute_loss(self, model, inputs, **kw):
        if self.state.global_step == 2:
            raise KeyError("user error at update 3")
        return super().compute_loss(model, inputs, **kw)


args = make_args("out", gradient_accumulation_steps=1, max_steps=6)
Failing(model=model, args=args, train_dataset=Tokens(64)).train()
"""
)

EXPLICIT = (
    COMMON
    + """
import traceml_ai as traceml
from traceml_ai.integrations import _common
from traceml_ai.integrations.huggingface import TraceMLTrainerCallback

assert os.environ["TRACEML_ZERO_CODE"] == "0"
traceml.init()

# A fault inside TraceML's own hook, at the 3rd step: reported once, training goes on.
calls = {"n": 0}
original_begin = _common.StepDriver.begin
def failing_begin(self, model):
    calls["n"] += 1
    if calls["n"] == 3:
        raise RuntimeError("injected hook fault")
    return original_begin(self, model)
_common.StepDriver.begin = failing_begin


class Failing(Trainer):
    def compute_loss(self, model, inputs, **kw):
        if self.state.global_step == 4:
            raise ValueError("user error at update 5")
        return super().compute_loss(model, inputs, **kw)


callback = TraceMLTrainerCallback()
args = make_args("out", gradient_accumulation_steps=2, max_steps=8, eval_strategy="steps",
                 eval_steps=1)
trainer = Failing(model=model, args=args, train_dataset=Tokens(64), eval_dataset=Tokens(12, 1),
                  callbacks=[callback])
try:
    trainer.train()
finally:
    print("HOOK_ERRORS", callback.hook_errors, flush=True)
"""
)


def test_zero_code_one_process_accumulation_and_evaluation(runs: Runs) -> None:
    folder, res = runs["zero_code"]
    assert res.returncode == 0, describe(res)
    assert "TRAINED True" in res.stdout, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    assert "could not attach" not in res.stderr, describe(res)

    (lines,) = steps_by_rank(folder).values()
    # One line per optimizer update; the 2 micro-batches fold into it.
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert set(line["events"]) == {STEP, FORWARD, BACKWARD, OPTIMIZER, DATALOADER}, line
        assert calls(line, FORWARD) == 2, line  # evaluation forwards are not counted
        assert calls(line, BACKWARD) == 2, line
        assert calls(line, OPTIMIZER) == 1, line
        assert calls(line, STEP) == 1, line
        # The update's micro-batches (Accelerate fetches one ahead); evaluation's
        # 3 batches after steps 2 and 4 are not in the next step.
        assert 1 <= calls(line, DATALOADER) <= 3, line
        (device,) = line["events"][STEP]
        assert device == "cpu"
        # Tokens from the batches (no attention_mask: input_ids, 4 x 16 each), the
        # update's two micro-batches added up; evaluation's batches are not counted.
        assert line["tokens"] == 2 * 4 * 16, line

    memory = stream_lines(folder, "step_memory")
    assert [m["step"] for m in memory] == [1, 2, 3, 4]
    assert {m["device"] for m in memory} == {"cpu"}
    assert stream_lines(folder, "process")
    assert stream_lines(folder, "runtime_environment")
    assert_all_streams_closed(folder)
    assert_valid(export_dir(folder / "logs", "run"), folder)


def test_zero_code_ddp_two_ranks(runs: Runs) -> None:
    folder, res = runs["ddp"]
    assert res.returncode == 0, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    assert "could not attach" not in res.stderr, describe(res)
    by_rank = steps_by_rank(folder)
    assert sorted(by_rank) == [0, 1]
    for lines in by_rank.values():
        assert [line["step"] for line in lines] == [1, 2, 3]
        for line in lines:
            assert calls(line, FORWARD) == 2 and calls(line, BACKWARD) == 2, line
            assert calls(line, OPTIMIZER) == 1, line
    environments = stream_lines(folder, "runtime_environment")
    assert {e["global_rank"] for e in environments} == {0, 1}
    assert {e["world_size"] for e in environments} == {2}
    assert {e["training_strategy"] for e in environments} == {"ddp"}
    memory = stream_lines(folder, "step_memory")
    assert sorted((m["global_rank"], m["step"]) for m in memory) == [
        (r, s) for r in (0, 1) for s in (1, 2, 3)
    ]
    assert_all_streams_closed(folder)


def test_zero_code_user_exception_propagates_and_run_is_finalized(runs: Runs) -> None:
    folder, res = runs["raises"]
    assert res.returncode == 1, describe(res)
    assert "KeyError: 'user error at update 3'" in res.stderr, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    assert "could not attach" not in res.stderr, describe(res)
    (lines,) = steps_by_rank(folder).values()
    # Updates 1 and 2 completed; the 3rd, which raised, ends as a raising
    # `with trace_step()` ends (recorded or dropped), never as a later step.
    assert [line["step"] for line in lines][:2] == [1, 2]
    assert len(lines) <= 3
    assert_all_streams_closed(folder)
    assert not (folder / "logs" / "run" / "finalization_warning.json").exists(), describe(res)


def test_explicit_callback_hook_fault_and_user_exception(runs: Runs) -> None:
    folder, res = runs["explicit"]
    # The user's exception propagates unchanged and fails the script...
    assert res.returncode == 1, describe(res)
    assert "ValueError: user error at update 5" in res.stderr, describe(res)
    # ...while TraceML's own hook fault was caught, counted and reported once.
    failures = integration_failures(res.stderr)
    assert failures == [
        "traceml: the Hugging Face Trainer integration failed in on_step_begin "
        "(RuntimeError('injected hook fault')); TraceML stops tracing this run's steps "
        "and training continues"
    ], describe(res)
    assert "HOOK_ERRORS 1" in res.stdout, describe(res)
    # Steps 1 and 2 were traced before the fault; the run was finalized.
    (lines,) = steps_by_rank(folder).values()
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert calls(line, FORWARD) == 2 and calls(line, OPTIMIZER) == 1, line
    # The evaluation after step 1 (3 batches) is dropped at on_evaluate, not in step 2.
    assert 1 <= calls(lines[1], DATALOADER) <= 3, lines[1]
    assert_all_streams_closed(folder)
    assert not (folder / "logs" / "run" / "finalization_warning.json").exists(), describe(res)


# The benches' switch (bench/overhead/workloads/one_in_k.py): every other update untraced.
WORKLOADS = Path(__file__).resolve().parents[3] / "bench" / "overhead" / "workloads"
ONE_IN_TWO = (
    COMMON
    + f"""
sys.path.insert(0, {str(WORKLOADS)!r})
from one_in_k import trace_one_in

trace_one_in(2)
args = make_args("out", gradient_accumulation_steps=2, max_steps=4)
Trainer(model=model, args=args, train_dataset=Tokens(64)).train()
sys.stdout.write("ALTERNATED\\n")
"""
)


def test_alternate_switch_traces_every_other_update(runs: Runs) -> None:
    folder, res = runs["one_in_2"]
    assert res.returncode == 0, describe(res)
    assert "ALTERNATED" in res.stdout, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    (lines,) = steps_by_rank(folder).values()
    # Updates 1 and 3 traced, 2 and 4 not: two steps, numbered on.
    assert [line["step"] for line in lines] == [1, 2]
    for line in lines:
        assert calls(line, FORWARD) == 2 and calls(line, BACKWARD) == 2, line
        assert calls(line, OPTIMIZER) == 1, line
        # The untraced update's fetches are not counted into the next traced step.
        assert 1 <= calls(line, DATALOADER) <= 3, line
    assert_all_streams_closed(folder)


# -- the runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every ``traceml run`` of this module, two at a time, each read by its test."""
    specs = {
        "zero_code": RunSpec("train_hf.py", ZERO_CODE, ("2", "4")),
        "ddp": RunSpec("train_hf.py", ZERO_CODE, ("2", "3"), nproc=2),
        "raises": RunSpec("train_hf_raises.py", ZERO_CODE_RAISES),
        "explicit": RunSpec("train_hf_explicit.py", EXPLICIT, env={"TRACEML_ZERO_CODE": "0"}),
        "one_in_2": RunSpec("alt_hf.py", ONE_IN_TWO),
    }
    return run_two_at_a_time(tmp_path_factory.mktemp("runs"), specs)
