"""TraceML with PyTorch Lightning: zero code under ``traceml run``, and the explicit
``TraceMLCallback``.

A small LightningModule trains on random data. Each run checks several things:

- zero code, 1 process: ``accumulate_grad_batches=2`` folds two batches into one step
  per update; the sanity check, validation inside ``fit()`` and ``validate()``/
  ``predict()`` after it are left out; every stream is exported and valid;
- zero code, 2 ranks (DDP, gloo): one step per update on each rank;
- zero code with the ``pytorch_lightning`` package, the user's ``training_step``
  raises: the exception propagates unchanged and the run is finalized;
- explicit callback imported before Lightning, automatic attach on: the trainer
  keeps that one callback; a hook failure is reported once and training continues;
- zero code is no callback: Lightning's loop methods are wrapped once per process
  (two trainers, two fits), a fit that raised leaves the next fit traced, a fault in
  the integration's own code is reported once and training continues;
- the benches' switch (bench/overhead/workloads/one_in_k.py): every other update traced;
- in this process (no ``traceml run``): importing the integration wraps nothing, and
  the wraps install once and come off again.

The runs start two at a time when the module starts (the ``runs`` fixture); a run read
by several tests runs once.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_helpers import REPO, assert_valid, clean_env, export_dir
from tests.integration_helpers import (
    BACKWARD,
    DATALOADER,
    FORWARD,
    OFFLINE_ENV,
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
    traceml_run,
    write_script,
)

pytest.importorskip("lightning")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

COMMON = """
import os, sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
import importlib
# The exception test uses the older package name, which the launcher patches too.
pl = importlib.import_module(os.environ.get("PL_PACKAGE", "lightning.pytorch"))


class Model(pl.LightningModule):
    def __init__(self, fail_at=-1):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        self.fail_at = fail_at

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        if self.global_step == self.fail_at:
            raise KeyError(f"user error at update {self.fail_at + 1}")
        x, y = batch
        return nn.functional.mse_loss(self(x), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def loader(n, seed):
    g = torch.Generator().manual_seed(seed)
    return DataLoader(TensorDataset(torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)),
                      batch_size=4)


def make_trainer(accumulate, max_steps, **kw):
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return pl.Trainer(
        accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
        max_steps=max_steps, accumulate_grad_batches=accumulate, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        **kw,
    )


torch.manual_seed(0)
"""

# No TraceML import: the launcher adds TraceMLCallback to every Trainer.
ZERO_CODE = (
    COMMON
    + """
accumulate, max_steps, fail_at = (int(a) for a in sys.argv[1:4])
print("PACKAGES", sorted(m for m in ("lightning", "pytorch_lightning") if m in sys.modules))
trainer = make_trainer(accumulate, max_steps, val_check_interval=4, limit_val_batches=3,
                       num_sanity_val_steps=2)
model = Model(fail_at)
trainer.fit(model, loader(64, 0), loader(12, 1))
trainer.validate(model, loader(12, 1), verbose=False)
trainer.predict(model, loader(8, 2))
sys.stdout.write(f"TRAINED {'traceml_ai' in sys.modules}\\n")  # one write per line
callback_names = sorted(type(c).__name__ for c in trainer.callbacks)
sys.stdout.write(f"TRACEML_CALLBACKS {[n for n in callback_names if 'TraceML' in n]}\\n")
"""
    + ddp_teardown("trainer", "model")
)

# The explicit form imported before Lightning, with the automatic attach on: the
# trainer keeps the one callback it was given.
EXPLICIT = (
    """
from traceml_ai.integrations.lightning import TraceMLCallback
"""
    + COMMON
    + """
import traceml_ai as traceml
from traceml_ai.integrations import _common

traceml.init()

# A fault inside TraceML's own hook at the 3rd step: reported once, training goes on.
calls = {"n": 0}
original_begin = _common.StepDriver.begin
def failing_begin(self, model):
    calls["n"] += 1
    if calls["n"] == 3:
        raise RuntimeError("injected hook fault")
    return original_begin(self, model)
_common.StepDriver.begin = failing_begin

callback = TraceMLCallback()
trainer = make_trainer(1, 6, callbacks=[callback], num_sanity_val_steps=0)
assert [c for c in trainer.callbacks if isinstance(c, TraceMLCallback)] == [callback]
trainer.fit(Model(), loader(64, 0))
sys.stdout.write(f"STEPS {trainer.global_step} HOOK_ERRORS {callback.hook_errors}\\n")  # one write
sys.stdout.flush()
"""
)


# Validation every 4 batches with 3 batches per update: after batches 4 and 8 it runs
# inside an open step (updates 2 and 3), each time 4 batches of 50 ms.
MID_UPDATE_VALIDATION = (
    COMMON
    + """
import time
explicit = sys.argv[1] == "explicit"


class SlowValidation(Model):
    def validation_step(self, batch, batch_idx):
        time.sleep(0.05)
        return super().validation_step(batch, batch_idx)


callbacks = []
if explicit:
    import traceml_ai as traceml
    from traceml_ai.integrations.lightning import TraceMLCallback
    traceml.init()
    callbacks = [TraceMLCallback()]
trainer = make_trainer(3, 4, val_check_interval=4, limit_val_batches=4, num_sanity_val_steps=0,
                       callbacks=callbacks)
trainer.fit(SlowValidation(), loader(64, 0), loader(16, 1))
sys.stdout.write("TRAINED\\n")
"""
)


@pytest.mark.parametrize("form", ["zero_code", "explicit"])
def test_validation_inside_an_accumulating_update_is_left_out_of_its_step(
    tmp_path: Path, form: str
) -> None:
    script = write_script(tmp_path, "train_pl.py", MID_UPDATE_VALIDATION)
    res = traceml_run(tmp_path, script, form)
    assert res.returncode == 0, describe(res)
    assert "TRAINED" in res.stdout, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    (lines,) = steps_by_rank(tmp_path).values()
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert calls(line, FORWARD) == 3 and calls(line, DATALOADER) == 3, line
        (step,) = line["events"][STEP].values()
        # Each validation took >= 200 ms; a step of three tiny batches takes a few.
        assert step["cpu_ms"] < 150, line


def test_zero_code_one_process_accumulation_and_evaluation(runs: Runs) -> None:
    folder, res = runs["zero_code"]
    assert res.returncode == 0, describe(res)
    assert "TRAINED True" in res.stdout, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    assert "could not attach" not in res.stderr, describe(res)

    (lines,) = steps_by_rank(folder).values()
    assert [line["step"] for line in lines] == [1, 2, 3, 4]
    for line in lines:
        assert set(line["events"]) == {STEP, FORWARD, BACKWARD, OPTIMIZER, DATALOADER}, line
        assert calls(line, FORWARD) == 2, line
        assert calls(line, BACKWARD) == 2, line
        assert calls(line, OPTIMIZER) == 1, line
        # Two batches per update; validation's 3 batches (after every 4 batches)
        # and the sanity check's 2 are not counted.
        assert calls(line, DATALOADER) == 2, line
        for entry in line["events"].values():
            (device,) = entry
            assert device == "cpu"
        # The optimizer phase is the update only, not the closure's forward and
        # backward (StepTimer.bracket): the phases do not overlap.
        ms = {name: line["events"][name]["cpu"]["cpu_ms"] for name in line["events"]}
        assert ms[FORWARD] + ms[BACKWARD] + ms[OPTIMIZER] <= ms[STEP], line
        # Tensor batches, no input_ids or attention_mask: no tokens said.
        assert "tokens" not in line, line
    memory = stream_lines(folder, "step_memory")
    assert [m["step"] for m in memory] == [1, 2, 3, 4]
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
    assert "ddp" in {e["training_strategy"] for e in environments}
    assert_all_streams_closed(folder)


def test_zero_code_user_exception_propagates_and_run_is_finalized(runs: Runs) -> None:
    pytest.importorskip("pytorch_lightning")
    folder, res = runs["user_exception"]
    assert res.returncode == 1, describe(res)
    assert "'pytorch_lightning'" in res.stdout, describe(res)
    assert "'lightning'" not in res.stdout, describe(res)
    assert "KeyError: 'user error at update 3'" in res.stderr, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    assert "could not attach" not in res.stderr, describe(res)
    (lines,) = steps_by_rank(folder).values()
    assert [line["step"] for line in lines][:2] == [1, 2]
    assert len(lines) <= 3
    assert_all_streams_closed(folder)
    assert not (folder / "logs" / "run" / "finalization_warning.json").exists(), describe(res)


def test_explicit_callback_hook_fault(runs: Runs) -> None:
    folder, res = runs["explicit"]
    assert res.returncode == 0, describe(res)
    assert "STEPS 6 HOOK_ERRORS 1" in res.stdout, describe(res)
    assert "could not attach" not in res.stderr, describe(res)
    assert integration_failures(res.stderr) == [
        "traceml: the Lightning integration failed in on_train_batch_start "
        "(RuntimeError('injected hook fault')); TraceML stops tracing this run's steps "
        "and training continues"
    ], describe(res)
    (lines,) = steps_by_rank(folder).values()
    assert [line["step"] for line in lines] == [1, 2]
    assert_all_streams_closed(folder)


# Zero code, several fits in one process: the first raises inside fit() at its 2nd
# update (caught by the script), the second runs 3 updates on a new trainer, then a
# fault is injected into the integration's own code during a third fit.
REFIT = (
    COMMON
    + """
from traceml_ai.integrations import _common
import torch.optim.optimizer as optim_module


def hooks():
    # torch's global optimizer step hooks (TraceML's pre- and post-hook, when in).
    return (len(optim_module._global_optimizer_pre_hooks),
            len(optim_module._global_optimizer_post_hooks))


hooks_in_fit = set()


class Hooks(pl.Callback):
    def on_train_batch_end(self, *args):
        hooks_in_fit.add(hooks())


if os.environ.get("TRACE_ONE_IN"):
    sys.path.insert(0, os.environ["BENCH_WORKLOADS"])
    from one_in_k import trace_one_in

    trace_one_in(int(os.environ["TRACE_ONE_IN"]))
    make_trainer(1, 6, num_sanity_val_steps=0).fit(Model(), loader(64, 0))
    sys.stdout.write("ALTERNATED\\n")
    sys.exit(0)

try:
    make_trainer(1, 6, num_sanity_val_steps=0, callbacks=[Hooks()]).fit(
        Model(fail_at=1), loader(64, 0))
except KeyError as exc:
    sys.stdout.write(f"CAUGHT {exc}\\n")
sys.stdout.write(f"HOOKS_AFTER_RAISE {hooks()}\\n")
trainer = make_trainer(1, 3, num_sanity_val_steps=0, callbacks=[Hooks()])
trainer.fit(Model(), loader(64, 0))
sys.stdout.write(f"HOOKS_IN_FIT {sorted(hooks_in_fit)} HOOKS_AFTER {hooks()}\\n")
Automatic = importlib.import_module(pl.__name__ + ".loops.optimization.automatic")._AutomaticOptimization
run = Automatic.run
once = run.__traceml_wrapped__ and not getattr(run.__wrapped__, "__traceml_wrapped__", False)
fit = type(trainer).fit
once = once and fit.__traceml_wrapped__ and not getattr(fit.__wrapped__, "__traceml_wrapped__", False)
sys.stdout.write(f"WRAPPED_ONCE {once}\\n")

calls = {"n": 0}
original_end = _common.StepDriver.end
def failing_end(self, exc=None):
    calls["n"] += 1
    if calls["n"] == 2:
        raise RuntimeError("injected fault")
    return original_end(self, exc)
_common.StepDriver.end = failing_end
third = make_trainer(1, 4, num_sanity_val_steps=0)
third.fit(Model(), loader(64, 0))
sys.stdout.write(f"THIRD {third.global_step} HOOKS_AFTER_FAULT {hooks()}\\n")
"""
)


def test_zero_code_is_no_callback_and_wraps_once(runs: Runs) -> None:
    # The one-process zero-code run (also read by the accumulation test); the
    # two-rank run says the same on each rank.
    for name in ("zero_code", "ddp"):
        folder, res = runs[name]
        assert res.returncode == 0, describe(res)
        assert "TRACEML_CALLBACKS []" in res.stdout, describe(res)
        assert "TRACEML_CALLBACKS ['" not in res.stdout, describe(res)  # on no rank
        # ... and yet its updates are traced (each run's own test checks every step).
        assert steps_by_rank(folder), describe(res)


def test_zero_code_refit_after_exception_and_own_fault(runs: Runs) -> None:
    folder, res = runs["refit"]
    assert res.returncode == 0, describe(res)
    assert "CAUGHT 'user error at update 2'" in res.stdout, describe(res)
    assert "WRAPPED_ONCE True" in res.stdout, describe(res)
    # The third fit trains to its end although the integration failed in it.
    assert "THIRD 4" in res.stdout, describe(res)
    # Automatic optimization: the bracket times the optimizer phase, and torch's
    # optimizer step hooks are out while a traced fit runs, back after it, whether it
    # returned, raised or lost its integration to a fault.
    assert "HOOKS_AFTER_RAISE (1, 1)" in res.stdout, describe(res)
    assert "HOOKS_IN_FIT [(0, 0)] HOOKS_AFTER (1, 1)" in res.stdout, describe(res)
    assert "HOOKS_AFTER_FAULT (1, 1)" in res.stdout, describe(res)
    assert integration_failures(res.stderr) == [
        "traceml: the Lightning integration failed in a training batch "
        "(RuntimeError('injected fault')); TraceML stops tracing this run's steps "
        "and training continues"
    ], describe(res)
    (lines,) = steps_by_rank(folder).values()
    # First fit: update 1 (update 2 raised: discarded). Second fit: 3 updates. Third
    # fit: end() raised at its first update (fit's start called it once before); the
    # guard's clean-up closed that step; nothing is traced after it.
    assert [line["step"] for line in lines] == [1, 2, 3, 4, 5]
    for line in lines:
        assert set(line["events"]) == {STEP, FORWARD, BACKWARD, OPTIMIZER, DATALOADER}, line
        assert calls(line, FORWARD) == 1 and calls(line, BACKWARD) == 1, line
        assert calls(line, OPTIMIZER) == 1, line
    assert_all_streams_closed(folder)


# Manual optimization, zero code: the user's training_step steps the optimizer every
# second batch; torch's optimizer hooks time that phase, and stay in during the fit.
MANUAL = (
    COMMON
    + """
import torch.optim.optimizer as optim_module

hooks_in_fit = set()


class ManualModel(Model):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        hooks_in_fit.add((len(optim_module._global_optimizer_pre_hooks),
                          len(optim_module._global_optimizer_post_hooks)))
        optimizer = self.optimizers()
        x, y = batch
        self.manual_backward(nn.functional.mse_loss(self(x), y))
        if batch_idx % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()


make_trainer(1, 3, num_sanity_val_steps=0).fit(ManualModel(), loader(64, 0))
sys.stdout.write(f"HOOKS_IN_FIT {sorted(hooks_in_fit)}\\n")
"""
)


def test_zero_code_manual_optimization_times_the_optimizer_with_its_hooks(runs: Runs) -> None:
    folder, res = runs["manual"]
    assert res.returncode == 0, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    assert "HOOKS_IN_FIT [(1, 1)]" in res.stdout, describe(res)
    (lines,) = steps_by_rank(folder).values()
    # Two batches per update (the second steps the optimizer): 3 updates.
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:
        assert calls(line, BACKWARD) == 2 and calls(line, OPTIMIZER) == 1, line
        ms = {name: line["events"][name]["cpu"]["cpu_ms"] for name in line["events"]}
        assert ms[BACKWARD] + ms[OPTIMIZER] <= ms[STEP], line
    assert_all_streams_closed(folder)


@pytest.mark.parametrize(("one_in", "traced"), [(2, 3), (4, 2)])
def test_bench_switch_traces_one_update_in_k(runs: Runs, one_in: int, traced: int) -> None:
    folder, res = runs[f"one_in_{one_in}"]
    assert res.returncode == 0, describe(res)
    assert "ALTERNATED" in res.stdout, describe(res)
    (lines,) = steps_by_rank(folder).values()
    # 6 updates: 1, 3, 5 traced (one in 2), or 1 and 5 (one in 4); numbered on.
    assert [line["step"] for line in lines] == list(range(1, traced + 1))
    for line in lines:
        # An untraced update's DataLoader fetch is not counted into the next step.
        assert calls(line, DATALOADER) == 1, line
        assert calls(line, FORWARD) == 1 and calls(line, OPTIMIZER) == 1, line


def test_import_wraps_nothing_and_install_is_once_and_undone() -> None:
    trainer_module = importlib.import_module("lightning.pytorch.trainer.trainer")
    automatic = importlib.import_module("lightning.pytorch.loops.optimization.automatic")
    original_fit = trainer_module.Trainer.__dict__["fit"]
    original_run = automatic._AutomaticOptimization.__dict__["run"]
    lightning = importlib.import_module("traceml_ai.integrations.lightning")
    # Outside `traceml run` nothing is wrapped (only the launcher's bootstrap installs).
    assert not getattr(original_fit, "__traceml_wrapped__", False)
    assert not getattr(original_run, "__traceml_wrapped__", False)
    try:
        lightning._install("lightning.pytorch")
        lightning._install("lightning.pytorch")
        run = automatic._AutomaticOptimization.__dict__["run"]
        assert run.__traceml_wrapped__ and run.__wrapped__ is original_run
        assert trainer_module.Trainer.__dict__["fit"].__wrapped__ is original_fit
        # No traced fit: the wrapper passes straight through.
        assert lightning._ZERO.trainer is None
    finally:
        lightning._uninstall()
    assert automatic._AutomaticOptimization.__dict__["run"] is original_run
    assert trainer_module.Trainer.__dict__["fit"] is original_fit


@pytest.mark.parametrize("manual", [False, True])
def test_the_update_count_read_from_the_loop_is_global_step(manual: bool) -> None:
    """The zero-code bracket reads trainer.global_step's counter from the loop that
    runs the batch (Lightning's private progress objects): it must be the same number,
    with gradient accumulation and with manual optimization."""
    import operator

    import lightning.pytorch as lpl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from traceml_ai.integrations import lightning as integration

    class Manual(lpl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = not manual
            self.net = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            loss = self.net(batch[0]).pow(2).mean()
            if not manual:
                return loss
            optimizer = self.optimizers()
            self.manual_backward(loss)
            if batch_idx % 2 == 1:  # an update every second batch
                optimizer.step()
                optimizer.zero_grad()
            return None

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    seen: list[tuple[int, int]] = []

    class Check(lpl.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            loop = trainer.fit_loop.epoch_loop
            if manual:
                read = operator.attrgetter(integration.UPDATES_MANUAL)(loop.manual_optimization)
            else:
                read = operator.attrgetter(integration.UPDATES_AUTOMATIC)(
                    loop.automatic_optimization
                )
            seen.append((read, trainer.global_step))

    trainer = lpl.Trainer(
        accelerator="cpu", max_steps=4, accumulate_grad_batches=1 if manual else 2,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[Check()],
    )  # fmt: skip
    data = TensorDataset(torch.randn(32, 4))
    trainer.fit(Manual(), DataLoader(data, batch_size=4))
    assert len(seen) >= 8 and seen[-1][1] == 4
    assert all(read == global_step for read, global_step in seen)


def test_the_explicit_callback_without_traceml_run_warns_once_at_the_users_line(
    tmp_path: Path,
) -> None:
    """Under plain ``python`` the callback's TraceML warning names the user's
    ``trainer.fit(...)`` line with its category, not the Lightning file that ran the
    hook (which Lightning prints without a category)."""
    script = write_script(
        tmp_path,
        "plain_pl.py",
        """
from traceml_ai.integrations.lightning import TraceMLCallback
"""
        + COMMON
        + """
trainer = make_trainer(1, 2, callbacks=[TraceMLCallback()], num_sanity_val_steps=0)
trainer.fit(Model(), loader(16, 0))  # FIT LINE
sys.stdout.write("TRAINED\\\\n")
""",
    )
    fit_line = (
        script.read_text().splitlines().index("trainer.fit(Model(), loader(16, 0))  # FIT LINE")
    )
    res = subprocess.run(
        [sys.executable, script], cwd=tmp_path, env=clean_env(OFFLINE_ENV),
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert res.returncode == 0 and "TRAINED" in res.stdout, describe(res)
    warned = [line for line in res.stderr.splitlines() if "TraceML export is off" in line]
    assert len(warned) == 1, describe(res)
    assert f"{script}:{fit_line + 1}: TraceMLWarning:" in warned[0], describe(res)


# -- the runs ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Every ``traceml run`` of this module that times nothing against a sleep, two at a
    time, each read by its tests. The mid-update validation runs compare a step's time
    with a validation's sleep, so they run alone in their test."""
    workloads = REPO / "bench" / "overhead" / "workloads"
    specs = {
        "zero_code": RunSpec("train_pl.py", ZERO_CODE, ("2", "4", "-1")),
        "ddp": RunSpec("train_pl.py", ZERO_CODE, ("2", "3", "-1"), nproc=2),
        "explicit": RunSpec("train_pl_explicit.py", EXPLICIT),
        "refit": RunSpec("refit_pl.py", REFIT),
        "manual": RunSpec("manual_pl.py", MANUAL),
        **{
            f"one_in_{k}": RunSpec(
                "alt_pl.py", REFIT, env={"TRACE_ONE_IN": str(k), "BENCH_WORKLOADS": str(workloads)}
            )
            for k in (2, 4)
        },
    }
    if importlib.util.find_spec("pytorch_lightning") is not None:  # else its test skips
        specs["user_exception"] = RunSpec(
            "train_pl.py", ZERO_CODE, ("1", "6", "2"), env={"PL_PACKAGE": "pytorch_lightning"}
        )
    return run_two_at_a_time(tmp_path_factory.mktemp("runs"), specs)
