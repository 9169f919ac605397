"""TraceML for the Hugging Face ``Trainer``: ``TraceMLTrainerCallback``, ``init()`` and
``TraceMLTrainer``.

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

TraceML 0.5.0's names work too (docs/compat-0.5.md): ``init()`` starts TraceML with
``mode="auto"`` and pauses its hooks during ``Trainer.evaluate``/``predict``, and
``TraceMLTrainer`` (0.3.x's wrapper, removed in 0.4.0) is a ``transformers.Trainer``
that adds the callback itself (``traceml_enabled=False``: it does not, and ``traceml
run`` does not attach one to it either). However many ways attach TraceML to one
trainer (an explicit callback, ``TraceMLTrainer``, ``traceml run``), each optimizer
update is one step.

Importing this module needs transformers: ``pip install 'traceml-ai[hf]'``.
"""

from __future__ import annotations

import functools
import importlib
import weakref
from collections.abc import Callable
from typing import Any

from traceml_ai.integrations._common import (
    GuardedCallback,
    HookGuard,
    StepDriver,
    not_installed,
    record_batch_tokens,
)

try:
    TrainerCallback: Any = importlib.import_module("transformers.trainer_callback").TrainerCallback
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise not_installed("huggingface", "transformers", "hf", _exc) from _exc

import traceml_ai as traceml
from traceml_ai.rank import TraceMLInitConfig, active, env_disabled

__all__ = ["TraceMLTrainer", "TraceMLTrainerCallback", "init"]

HAS_TRANSFORMERS = True
"""TraceML 0.5.0's flag; always true here (without transformers this module does not
import)."""

TraceMLTrainer: Any
"""A ``transformers.Trainer`` that adds ``TraceMLTrainerCallback`` (made at first use,
by the module's ``__getattr__``)."""

FRAMEWORK = "Hugging Face Trainer"


class TraceMLTrainerCallback(GuardedCallback, TrainerCallback):  # type: ignore[misc]
    """Traces each optimizer update of ``Trainer.train()`` as one TraceML step; its
    hooks are guarded (:class:`~traceml_ai.integrations._common.GuardedCallback`)."""

    framework = FRAMEWORK

    def __init__(self) -> None:
        super().__init__()
        # Set when attached by `traceml run`: the trainer's wrapped (DDP) model is
        # then traced, so runtime_environment names the strategy.
        self._trainer: Callable[[], object | None] | None = None

    def _model(self, kwargs: dict[str, Any]) -> object | None:
        trainer = self._trainer() if self._trainer is not None else None
        wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        return wrapped if wrapped is not None else kwargs.get("model")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard.run("on_train_begin", self._driver.start)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._guard.run("on_step_begin", lambda: self._begin(kwargs))

    def _begin(self, kwargs: dict[str, Any]) -> None:
        driver = self._driver
        if not driver.open:
            timer = active()
            if timer is not None and timer.in_step:
                # Another TraceML callback on this trainer (or the script's own
                # trace_step) has the step open: it is counted once, by that one.
                return
        driver.begin(self._model(kwargs))

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


# -- zero-code attach under `traceml run` (traceml_ai.launch.bootstrap) ------------------------


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
_TOKENS_GUARD = HookGuard(FRAMEWORK, lambda: None)


def _guarded_attach(trainer: Any, *, add: bool = True) -> TraceMLTrainerCallback | None:
    """The trainer's TraceML callback, added when it has none (``add``); ``None`` for a
    ``TraceMLTrainer(traceml_enabled=False)``."""
    if getattr(trainer, "_traceml_opted_out", False):
        return None
    attached: list[TraceMLTrainerCallback] = []

    def find() -> None:
        callback = _attach(trainer) if add else _callback_of(trainer)
        if callback is not None:
            attached.append(callback)

    _ATTACH_GUARD.run("Trainer.train", find)
    return attached[0] if attached else None


def _wrap_train(original: Callable[..., Any], *, add: bool = True) -> Callable[..., Any]:
    """``Trainer.train``: attach the callback (``add``; ``traceml run``), and close a
    step left open when training returns or raises."""

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        callback = _guarded_attach(self, add=add)
        _ATTACH_GUARD.run("Trainer.training_step", lambda: _count_tokens_of(type(self)))
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


def _count_tokens_of(trainer_cls: Any) -> None:
    """Wrap ``training_step`` of the trainer's class (once): each micro-batch's tokens
    (``attention_mask.sum()``, else ``input_ids.numel()``) add to the open step."""
    original = getattr(trainer_cls, "training_step", None)
    if not callable(original) or getattr(original, "__traceml_tokens__", False):
        return

    @functools.wraps(original)
    def training_step(self: Any, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        _TOKENS_GUARD.run("Trainer.training_step", lambda: record_batch_tokens(inputs))
        return original(self, model, inputs, *args, **kwargs)

    training_step.__traceml_tokens__ = True  # type: ignore[attr-defined]
    trainer_cls.training_step = training_step


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


# -- TraceML 0.5.0's init() and 0.3.x's TraceMLTrainer --------------------------------------


def _install_trainer_wraps() -> None:
    """Wrap ``Trainer.train`` (closes a step left open; attaches nothing) and
    ``evaluate``/``predict`` (hooks paused) once per process, unless ``traceml run``
    already did (its wraps attach the callback as well)."""
    trainer_cls = importlib.import_module("transformers").Trainer
    for name in ("train", "evaluate", "predict"):
        original = getattr(trainer_cls, name, None)
        if not callable(original) or getattr(original, "__traceml_wrapped__", False):
            continue
        wrapper = _wrap_train(original, add=False) if name == "train" else _wrap_loop(original)
        setattr(trainer_cls, name, wrapper)


def init() -> TraceMLInitConfig:
    """Start TraceML for a Hugging Face ``Trainer`` run, as TraceML 0.5.0's
    ``traceml_ai.integrations.huggingface.init()`` does: ``traceml.init(mode="auto")``
    (forward, backward, optimizer step, DataLoader waits and host-to-device copies are
    timed), returning its config. It also pauses TraceML's hooks while
    ``Trainer.evaluate``/``predict`` run and closes a step that an exception left
    open. Register ``TraceMLTrainerCallback()`` with the trainer (``traceml run`` does
    that for you). A second call returns the running config.
    """
    config = traceml.init(mode="auto")
    if not config.disabled:
        _ATTACH_GUARD.run("init", _install_trainer_wraps)
    return config


_TRACEML_TRAINER: Any = None


def _trainer_class() -> Any:
    """``TraceMLTrainer``, made at its first use: ``transformers.Trainer`` is imported
    then, not when this module is (``traceml run`` imports it from inside that import)."""
    global _TRACEML_TRAINER
    if _TRACEML_TRAINER is not None:
        return _TRACEML_TRAINER
    base: Any = importlib.import_module("transformers").Trainer

    class TraceMLTrainer(base):  # type: ignore[misc]
        """A ``transformers.Trainer`` that adds ``TraceMLTrainerCallback`` itself (TraceML
        0.3.x's wrapper): ``TraceMLTrainer(model=..., args=..., traceml_enabled=True)``.

        ``traceml_enabled=False`` (or ``TRACEML_DISABLED=1``) adds no callback, and
        ``traceml run`` attaches none to this trainer. A ``TraceMLTrainerCallback``
        already in ``callbacks`` is used instead of a second one.
        """

        def __init__(self, *args: Any, traceml_enabled: bool = True, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.traceml_enabled = traceml_enabled
            opted_out = traceml_enabled is False or env_disabled()
            self._traceml_opted_out = opted_out
            if opted_out:
                return
            _ATTACH_GUARD.run("TraceMLTrainer", lambda: _attach(self))

    TraceMLTrainer.__module__ = __name__
    TraceMLTrainer.__qualname__ = "TraceMLTrainer"
    _TRACEML_TRAINER = TraceMLTrainer
    return TraceMLTrainer


def __getattr__(name: str) -> Any:
    if name == "TraceMLTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
