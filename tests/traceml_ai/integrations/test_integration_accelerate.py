"""TraceML in Accelerate loops: ``traceml_ai.integrations.accelerate.accumulate``.

A tiny MLP trains with ``accelerator.accumulate`` replaced by ``accumulate(accelerator,
model)``. Three runs: 1 process with gradient accumulation, an evaluation loop inside
``evaluation()`` and a user exception at the end; 2 ranks (DDP, gloo); a fault inside
the integration, reported once while training continues.
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
    assert_all_streams_closed,
    calls,
    ddp_teardown,
    describe,
    integration_failures,
    steps_by_rank,
    stream_lines,
    traceml_run,
    write_script,
)

pytest.importorskip("accelerate")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SCRIPT = """
import sys
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator
import traceml_ai as traceml
from traceml_ai.integrations import _common
from traceml_ai.integrations.accelerate import accumulate, evaluation, hook_errors

accumulation, fail_at, fault_at = (int(a) for a in sys.argv[1:4])
if fault_at > 0:
    count = {"n": 0}
    original_begin = _common.StepDriver.begin
    def failing_begin(self, model):
        count["n"] += 1
        if count["n"] == fault_at:
            raise RuntimeError("injected hook fault")
        return original_begin(self, model)
    _common.StepDriver.begin = failing_begin

traceml.init()
accelerator = Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
model, optimizer, loader, eval_loader = accelerator.prepare(
    model, optimizer, DataLoader(data, batch_size=4), DataLoader(data, batch_size=8))
updates = 0
for i, (x, y) in enumerate(loader):
    with accumulate(accelerator, model):
        if updates + 1 == fail_at:
            raise ValueError(f"user error at update {fail_at}")
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if accelerator.sync_gradients:
        updates += 1
        if updates % 2 == 0:
            with evaluation(), torch.no_grad():
                for ex, ey in eval_loader:
                    model(ex)
# One write per line: ranks share stdout (unbuffered here), and print writes each
# argument and the newline separately, so two ranks' lines could interleave.
sys.stdout.write(f"UPDATES {updates} HOOK_ERRORS {hook_errors()}\\n")
sys.stdout.flush()
""" + ddp_teardown("model", "optimizer")


def test_accumulation_evaluation_and_user_exception(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train_acc.py", SCRIPT)
    res = traceml_run(tmp_path, script, "2", "6", "0")
    assert res.returncode == 1, describe(res)
    assert "ValueError: user error at update 6" in res.stderr, describe(res)
    assert not integration_failures(res.stderr), describe(res)
    (lines,) = steps_by_rank(tmp_path).values()
    assert [line["step"] for line in lines][:5] == [1, 2, 3, 4, 5]
    assert len(lines) <= 6
    for line in lines[:5]:
        assert calls(line, FORWARD) == 2 and calls(line, BACKWARD) == 2, line
        assert calls(line, OPTIMIZER) == 1, line
        # The update's two batches (Accelerate fetches one ahead); the evaluation's
        # 8 batches after every 2nd update are not counted.
        assert 1 <= calls(line, DATALOADER) <= 3, line
    assert_all_streams_closed(tmp_path)
    assert not (tmp_path / "logs" / "run" / "finalization_warning.json").exists(), describe(res)
    assert_valid(export_dir(tmp_path / "logs", "run"), tmp_path)


def test_ddp_two_ranks(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train_acc.py", SCRIPT)
    res = traceml_run(tmp_path, script, "2", "0", "0", nproc=2)
    assert res.returncode == 0, describe(res)
    assert res.stdout.count("UPDATES 4 HOOK_ERRORS 0") == 2, describe(res)
    by_rank = steps_by_rank(tmp_path)
    assert sorted(by_rank) == [0, 1]
    for lines in by_rank.values():
        assert [line["step"] for line in lines] == [1, 2, 3, 4]
        for line in lines:
            assert calls(line, FORWARD) == 2 and calls(line, OPTIMIZER) == 1, line
    environments = stream_lines(tmp_path, "runtime_environment")
    assert "ddp" in {e["training_strategy"] for e in environments}
    assert_all_streams_closed(tmp_path)


def test_integration_fault_is_reported_once(tmp_path: Path) -> None:
    script = write_script(tmp_path, "train_acc.py", SCRIPT)
    res = traceml_run(tmp_path, script, "1", "0", "3")
    assert res.returncode == 0, describe(res)
    assert "UPDATES 16 HOOK_ERRORS 1" in res.stdout, describe(res)
    assert integration_failures(res.stderr) == [
        "traceml: the Accelerate integration failed in accumulate "
        "(RuntimeError('injected hook fault')); TraceML stops tracing this run's steps "
        "and training continues"
    ], describe(res)
    (lines,) = steps_by_rank(tmp_path).values()
    assert [line["step"] for line in lines] == [1, 2]
    assert_all_streams_closed(tmp_path)
