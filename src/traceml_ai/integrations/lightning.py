"""TraceML for PyTorch Lightning: ``TraceMLCallback``.

Under ``traceml run`` nothing needs to change in the script: the launcher adds this
callback to every ``lightning.pytorch.Trainer`` (and ``pytorch_lightning.Trainer``).
Launched otherwise (or to be explicit), add it yourself::

    import lightning.pytorch as pl
    from traceml_ai.integrations.lightning import TraceMLCallback

    trainer = pl.Trainer(max_epochs=1, callbacks=[TraceMLCallback()])
    trainer.fit(model, train_loader)

Each optimizer update is one traced step: with ``accumulate_grad_batches=k`` the
``k`` batches fold into it (``n_calls`` says how many). Phases: ``forward`` is the
``training_step`` (from the batch's start until ``backward`` begins, so it includes
``zero_grad`` when Lightning calls it there), ``backward``, ``optimizer_step`` (the
update only, after Lightning's closure has run forward and backward) and the
DataLoader waits. Sanity check, validation, test and predict loops are not training
steps: no hook reports while they run.

Importing this module needs Lightning: ``pip install 'traceml-ai[lightning]'``.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from typing import Any

from traceml_ai.integrations._common import HookGuard, StepDriver


def _callback_base() -> Any:
    """Lightning's ``Callback`` class, from the package the script uses.

    Taken from the defining module, not the package: under ``traceml run`` this
    module is imported while that package is still initializing. A script that
    imported only ``pytorch_lightning`` gets its class (importing ``lightning``
    then would initialize a second package, and patch its Trainer, from here).
    """
    names = ["lightning.pytorch", "pytorch_lightning"]
    if "pytorch_lightning" in sys.modules and "lightning.pytorch" not in sys.modules:
        names.reverse()
    error: ImportError | None = None
    for name in names:
        try:
            return importlib.import_module(f"{name}.callbacks.callback").Callback
        except ImportError as exc:
            error = error or exc
    raise ImportError(
        "traceml_ai.integrations.lightning needs Lightning, which is not installed "
        f"({error}). Install it with: pip install 'traceml-ai[lightning]'"
    )


Callback: Any = _callback_base()

__all__ = ["TraceMLCallback"]

FRAMEWORK = "Lightning"


class TraceMLCallback(Callback):  # type: ignore[misc]
    """Traces each optimizer update of ``Trainer.fit()`` as one TraceML step.

    Every hook catches its own exceptions: the first is reported once as a
    ``traceml:`` line, ``hook_errors`` counts them, and the callback is then off for
    the run; training is never interrupted by it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._driver = StepDriver()
        self._guard = HookGuard(FRAMEWORK, self._driver.abandon)
        self._global_step = 0

    @property
    def hook_errors(self) -> int:
        """How many of this callback's hooks raised (each was caught)."""
        return self._guard.errors

    # -- training ------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._guard.run("on_fit_start", self._driver.start)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        def begin() -> None:
            driver = self._driver
            if not driver.open:
                # The strategy's model is the DDP wrapper under DDP: its forward runs
                # the training_step, and it names the strategy in runtime_environment.
                model = getattr(getattr(trainer, "strategy", None), "model", None)
                driver.begin(model if model is not None else pl_module)
                self._global_step = trainer.global_step
            driver.open_forward()

        self._guard.run("on_train_batch_start", begin)

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._guard.run("on_before_backward", self._driver.close_forward)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._guard.run("on_before_optimizer_step", self._driver.restart_optimizer)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        def end() -> None:
            driver = self._driver
            driver.close_forward()  # a training_step without backward
            # global_step counts optimizer updates: an accumulating batch leaves it as
            # it was, and its step stays open for the next batch.
            if trainer.global_step != self._global_step:
                driver.end()

        self._guard.run("on_train_batch_end", end)

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        # A step never spans two epochs (an epoch whose batches did not update).
        self._guard.run("on_train_epoch_end", self._driver.end)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self._guard.run("on_train_end", self._driver.end)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # The step that raised ends as `with trace_step(...)` ends when its body
        # raises; Lightning re-raises the exception itself.
        def close() -> None:
            self._driver.resume()
            self._driver.close_forward()
            self._driver.end(exception)

        self._guard.run("on_exception", close)

    # -- loops that are not training steps ----------------------------------------------

    def _pause(self, hook: str) -> None:
        self._guard.run(hook, self._driver.pause)

    def _resume(self, hook: str) -> None:
        self._guard.run(hook, self._driver.resume)

    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        self._pause("on_sanity_check_start")

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        self._resume("on_sanity_check_end")

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self._pause("on_validation_start")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._resume("on_validation_end")

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        self._pause("on_test_start")

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._resume("on_test_end")

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        self._pause("on_predict_start")

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._resume("on_predict_end")


# -- zero-code attach under `traceml run` (traceml_ai._bootstrap) ------------------------

_ATTACH_GUARD = HookGuard(FRAMEWORK, lambda: None)


def _attach(trainer: Any) -> None:
    callbacks = trainer.callbacks
    if not any(isinstance(callback, TraceMLCallback) for callback in callbacks):
        callbacks.append(TraceMLCallback())


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        _ATTACH_GUARD.run("Trainer.__init__", lambda: _attach(self))

    __init__.__traceml_wrapped__ = True  # type: ignore[attr-defined]
    return __init__
