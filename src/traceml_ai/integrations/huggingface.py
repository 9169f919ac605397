"""TraceML for the Hugging Face ``Trainer``: ``TraceMLTrainerCallback``.

Under ``traceml run`` nothing needs to change in the script: the launcher attaches this
callback to every ``transformers.Trainer`` when ``train()`` is called. Launched
otherwise (or to be explicit), add it yourself::

    import traceml_ai as traceml
    from traceml_ai.integrations.huggingface import TraceMLTrainerCallback

    traceml.init()
    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[TraceMLTrainerCallback()])
    trainer.train()

Each optimizer update is one traced step: with ``gradient_accumulation_steps=k`` the
``k`` micro-batches' forward and backward fold into it (``n_calls`` says how many),
and the DataLoader waits for them too. Evaluation and prediction are not training
steps: their batches are not traced and their DataLoader waits are left out.

Importing this module needs transformers: ``pip install 'traceml-ai[hf]'``.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from typing import Any

try:
    TrainerCallback: Any = importlib.import_module("transformers.trainer_callback").TrainerCallback
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "traceml_ai.integrations.huggingface needs transformers, which is not installed "
        f"({_exc}). Install it with: pip install 'traceml-ai[hf]'"
    ) from _exc

from traceml_ai.integrations._common import HookGuard, StepDriver

__all__ = ["TraceMLTrainerCallback"]

FRAMEWORK = "Hugging Face Trainer"


class TraceMLTrainerCallback(TrainerCallback):  # type: ignore[misc]
    """Traces each optimizer update of ``Trainer.train()`` as one TraceML step.

    Every hook catches its own exceptions: the first is reported once as a
    ``traceml:`` line, ``hook_errors`` counts them, and the callback is then off for
    the run; training is never interrupted by it.
    """

    def __init__(self) -> None:
        super().__init__()
        self._driver = StepDriver()
        self._guard = HookGuard(FRAMEWORK, self._driver.abandon)
        # Set when attached by `traceml run`: the trainer's wrapped (DDP) model is
        # then traced, so runtime_environment names the strategy.
        self._trainer: Callable[[], object | None] | None = None

    @property
    def hook_errors(self) -> int:
        """How many of this callback's hooks raised (each was caught)."""
        return self._guard.errors

    def _model(self, kwargs: dict[str, Any]) -> object | None:
        trainer = self._trainer() if self._trainer is not None else None
        wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        return wrapped if wrapped is not None else kwargs.get("model")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard.run("on_train_begin", self._driver.start)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard.run("on_step_begin", lambda: self._driver.begin(self._model(kwargs)))

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard.run("on_step_end", self._driver.end)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # Evaluation ran between two steps: its batch fetches are not the next step's.
        self._guard.run("on_evaluate", self._driver.discard_dataloader_waits)

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard.run("on_predict", self._driver.discard_dataloader_waits)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard.run("on_train_end", self._driver.end)

    def _close_after_train(self, exc: BaseException | None) -> None:
        """``train()`` returned or raised ``exc``: close a step its exception left open."""
        self._guard.run("train", lambda: self._driver.end(exc))


# -- zero-code attach under `traceml run` (traceml_ai._bootstrap) ------------------------


def _callback_of(trainer: Any) -> TraceMLTrainerCallback | None:
    handler = getattr(trainer, "callback_handler", None)
    for callback in getattr(handler, "callbacks", ()):
        if isinstance(callback, TraceMLTrainerCallback):
            return callback
    return None


def _attach(trainer: Any) -> TraceMLTrainerCallback:
    callback = _callback_of(trainer)
    if callback is None:
        callback = TraceMLTrainerCallback()
        trainer.add_callback(callback)
    if callback._trainer is None:
        callback._trainer = weakref.ref(trainer)
    return callback


_ATTACH_GUARD = HookGuard(FRAMEWORK, lambda: None)
_LOOP_GUARD = HookGuard(FRAMEWORK, lambda: None)


def _guarded_attach(trainer: Any) -> TraceMLTrainerCallback | None:
    attached: list[TraceMLTrainerCallback] = []
    _ATTACH_GUARD.run("Trainer.train", lambda: attached.append(_attach(trainer)))
    return attached[0] if attached else None


def _wrap_train(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = _guarded_attach(self)
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            # The user's exception propagates unchanged; closing never raises.
            if callback is not None:
                callback._close_after_train(exc)
            raise
        if callback is not None:
            callback._close_after_train(None)
        return result

    train.__traceml_wrapped__ = True  # type: ignore[attr-defined]
    return train


def _wrap_loop(original: Callable[..., Any]) -> Callable[..., Any]:
    """``evaluate``/``predict``: no hook reports while they run (not training steps)."""

    @functools.wraps(original)
    def loop(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Its own driver: evaluate() may come before train() attached a callback.
        driver = StepDriver()
        _LOOP_GUARD.run("Trainer.evaluate", driver.pause)
        try:
            return original(self, *args, **kwargs)
        finally:
            _LOOP_GUARD.run("Trainer.evaluate", driver.resume)

    loop.__traceml_wrapped__ = True  # type: ignore[attr-defined]
    return loop
