"""Tokens per step: ``trace_step(model, tokens=n)``, ``traceml.record_tokens(n)`` inside
the step, and the integrations' count from a batch (``attention_mask.sum()``, else
``input_ids.numel()``) — on the step_time line only when said."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import traceml_ai as traceml
from traceml_ai import TraceMLWarning
from traceml_ai.integrations._common import record_batch_tokens
from traceml_ai.testing import ExportCapture, reset


@pytest.fixture
def capture() -> Iterator[ExportCapture]:
    reset()
    sink = ExportCapture()
    traceml.init(sink=sink)
    yield sink
    reset()


def _steps(capture: ExportCapture) -> list[int | None]:
    traceml.shutdown()
    return [r.tokens for r in capture.records("step_time")]


def test_tokens_from_trace_step_and_record_tokens(capture: ExportCapture) -> None:
    model = torch.nn.Linear(4, 1)
    with traceml.trace_step(model, tokens=100):
        model(torch.randn(2, 4)).sum().backward()
    with traceml.trace_step(model):
        traceml.record_tokens(30)
        traceml.record_tokens(12)  # a second micro-batch adds to the step's count
    with traceml.trace_step(model):
        pass
    assert _steps(capture) == [100, 42, None]
    lines = capture.lines("step_time")
    assert b'"tokens":100' in lines[0] and b"tokens" not in lines[2]  # absent, not null


def test_the_integrations_count_a_batch(capture: ExportCapture) -> None:
    model = torch.nn.Linear(4, 1)
    ids = torch.ones(2, 8, dtype=torch.long)
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8])
    with traceml.trace_step(model):
        record_batch_tokens({"input_ids": ids, "attention_mask": mask})  # padding left out
    with traceml.trace_step(model):
        record_batch_tokens({"input_ids": ids})
    with traceml.trace_step(model):
        record_batch_tokens((ids, ids))  # a tuple batch says nothing
        record_batch_tokens({"labels": ids})
    record_batch_tokens({"input_ids": ids})  # outside a step: nothing kept
    assert _steps(capture) == [13, 16, None]


@pytest.mark.parametrize("bad", [-1, True, 1.5, "7", torch.ones(2, dtype=torch.long)])
def test_a_bad_count_is_one_warning_and_training_goes_on(
    capture: ExportCapture, bad: object
) -> None:
    model = torch.nn.Linear(4, 1)
    warned = pytest.warns(TraceMLWarning, match="whole number >= 0")
    with warned, traceml.trace_step(model, tokens=bad):  # type: ignore[arg-type]
        traceml.record_tokens(bad)  # type: ignore[arg-type]
    with traceml.trace_step(model, tokens=torch.tensor(9)):  # a 0-d tensor is a count
        pass
    assert _steps(capture) == [None, 9]
