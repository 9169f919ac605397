"""TraceML for Hugging Face Accelerate loops: ``accumulate(accelerator, model)``.

Use it where the loop uses ``accelerator.accumulate(model)``::

    import traceml_ai as traceml
    from traceml_ai.integrations.accelerate import accumulate

    traceml.init()
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        with accumulate(accelerator, model):  # enters accelerator.accumulate(model)
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()

It enters ``accelerator.accumulate(*models)`` and traces one step per optimizer
update: a step begins with the first micro-batch after an update and ends when
Accelerate syncs gradients (``accelerator.sync_gradients``), so with
``gradient_accumulation_steps=k`` the ``k`` micro-batches' forward and backward fold
into it (``n_calls`` says how many). An exception from the block propagates unchanged
and ends the step as an exception ends ``with traceml.trace_step(...)``.

Evaluation is not a training step: run it inside ``with evaluation():`` so that its
DataLoader waits are not counted toward the next training step.

Importing this module needs Accelerate: ``pip install 'traceml-ai[hf]'``.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
from collections.abc import Iterator
from typing import Any

from traceml_ai.integrations._common import HookGuard, StepDriver, not_installed

try:
    importlib.import_module("accelerate")
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise not_installed("accelerate", "accelerate", "hf", _exc) from _exc

__all__ = ["accumulate", "evaluation", "hook_errors"]

FRAMEWORK = "Accelerate"

# One training loop per process: one open step at a time.
_DRIVER = StepDriver()
_GUARD = HookGuard(FRAMEWORK, _DRIVER.abandon)


def hook_errors() -> int:
    """How many times this integration's own code raised (each was caught)."""
    return _GUARD.errors


@contextlib.contextmanager
def accumulate(accelerator: Any, *models: Any) -> Iterator[None]:
    """``accelerator.accumulate(*models)``, traced: one TraceML step per optimizer update."""
    with accelerator.accumulate(*models):
        model = models[0] if models else None
        _GUARD.run("accumulate", lambda: _DRIVER.begin(model))
        try:
            yield
        except BaseException as exc:
            # The user's exception propagates unchanged; the step ends as
            # `with trace_step(...)` ends when its body raises.
            _GUARD.run("accumulate", functools.partial(_DRIVER.end, exc))
            raise
        # Accelerate decided on entering whether this micro-batch ends an update.
        if getattr(accelerator, "sync_gradients", True):
            _GUARD.run("accumulate", _DRIVER.end)


@contextlib.contextmanager
def evaluation() -> Iterator[None]:
    """Code inside is no training step: an evaluation loop's batch fetches and forwards
    are not counted toward the next traced step."""
    _GUARD.run("evaluation", _DRIVER.pause)
    try:
        yield
    finally:
        _GUARD.run("evaluation", _DRIVER.resume)
