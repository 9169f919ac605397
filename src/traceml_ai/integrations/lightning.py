"""TraceML for PyTorch Lightning: ``TraceMLCallback``.

Under ``traceml run`` nothing needs to change in the script: the launcher traces
every ``lightning.pytorch.Trainer`` (and ``pytorch_lightning.Trainer``) ``fit()``, not
through a callback but by wrapping a few of Lightning's loop methods once (cheaper:
see the zero-code section below). Launched otherwise (or to be explicit), add the
callback yourself::

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

TraceML 0.5.0's ``init()`` works too (docs/compat-0.5.md): it starts TraceML with
``mode="auto"``. An explicit ``TraceMLCallback`` under ``traceml run`` traces that
trainer alone (the zero-code wraps pass through for it), so each update is one step.
With backward or the optimizer step not timed automatically (``init(mode="manual")``
or ``"selective"``), the callback times them itself, from ``on_before_backward`` to
``on_after_backward`` and from ``on_before_optimizer_step`` to the batch's end, as
0.5.0's callback does.

Importing this module needs Lightning: ``pip install 'traceml-ai[lightning]'``.
"""

from __future__ import annotations

import functools
import importlib
import operator
import sys
from collections.abc import Callable
from typing import Any

import traceml_ai as traceml
from traceml_ai.integrations._common import (
    GuardedCallback,
    HookGuard,
    StepDriver,
    not_installed,
    record_batch_tokens,
)
from traceml_ai.rank import (
    BACKWARD,
    FORWARD,
    OPTIMIZER_STEP,
    StepTimer,
    TraceMLInitConfig,
    active,
    forward_timed_elsewhere,
    resume_optimizer_hooks,
    suspend_optimizer_hooks,
)


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
    raise not_installed("lightning", "Lightning", "lightning", error)


Callback: Any = _callback_base()

IS_LIGHTNING_AVAILABLE = True
"""TraceML 0.5.0's flag; always true here (without Lightning this module does not
import)."""

__all__ = ["TraceMLCallback", "init"]

FRAMEWORK = "Lightning"


def init() -> TraceMLInitConfig:
    """Start TraceML for a Lightning run, as TraceML 0.5.0's
    ``traceml_ai.integrations.lightning.init()`` is called: returns the config.

    Here it is ``traceml.init(mode="auto")``: forward, backward, the optimizer step,
    DataLoader waits and host-to-device copies are timed (0.5.0 asks for
    ``mode="selective"`` with DataLoader and host-to-device patches and lets its
    callback time the rest; this project's hooks time them in ``auto`` mode, with or
    without the callback). A second call returns the running config.
    """
    return traceml.init(mode="auto")


class TraceMLCallback(GuardedCallback, Callback):  # type: ignore[misc]
    """Traces each optimizer update of ``Trainer.fit()`` as one TraceML step; its
    hooks are guarded (:class:`~traceml_ai.integrations._common.GuardedCallback`)."""

    framework = FRAMEWORK

    def __init__(self) -> None:
        super().__init__()
        self._global_step = 0
        # The phases this callback opened itself (not timed automatically).
        self._own_backward = False
        self._own_optimizer = False

    # -- training ------------------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._guard.run("on_fit_start", self._driver.start)

    def on_train_batch_start(
        self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int
    ) -> None:
        def begin() -> None:
            driver = self._driver
            if not driver.open:
                timer = active()
                if timer is not None and timer.in_step:
                    # Another TraceMLCallback on this trainer (or the script's own
                    # trace_step) has the step open: it is counted once, by that one.
                    return
                # The strategy's model is the DDP wrapper under DDP: its forward runs
                # the training_step, and it names the strategy in runtime_environment.
                model = getattr(getattr(trainer, "strategy", None), "model", None)
                driver.begin(model if model is not None else pl_module)
                self._global_step = trainer.global_step
            driver.open_forward()
            if driver.open:
                record_batch_tokens(batch)

        self._guard.run("on_train_batch_start", begin)

    def _own_timer(self) -> StepTimer | None:
        """The active timer while this callback's step is open, else ``None``."""
        timer = active()
        return timer if timer is not None and self._driver.current is not None else None

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        def before() -> None:
            self._driver.close_forward()
            timer = self._own_timer()
            if timer is not None:
                self._close_own_optimizer(timer)  # manual optimization: one step per call
                if not timer.auto_backward and not self._own_backward:
                    self._own_backward = True
                    timer.open(timer.bwd)

        self._guard.run("on_before_backward", before)

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        def after() -> None:
            timer = active()
            if self._own_backward:
                self._own_backward = False
                if timer is not None:
                    timer.close(timer.bwd, BACKWARD)

        self._guard.run("on_after_backward", after)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        def before() -> None:
            self._driver.restart_optimizer()
            timer = self._own_timer()
            if timer is not None and not timer.auto_optimizer:
                self._close_own_optimizer(timer)
                self._own_optimizer = True
                timer.open(timer.opt)

        self._guard.run("on_before_optimizer_step", before)

    def _close_own_optimizer(self, timer: StepTimer | None) -> None:
        if self._own_optimizer:
            self._own_optimizer = False
            if timer is not None:
                timer.close(timer.opt, OPTIMIZER_STEP)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        def end() -> None:
            driver = self._driver
            driver.close_forward()  # a training_step without backward
            self._close_own_optimizer(active())
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
            self._own_backward = self._own_optimizer = False
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


# -- zero-code attach under `traceml run` (traceml_ai.launch.bootstrap) ------------------------
#
# Not a callback: Lightning dispatches every hook of every callback through a profiler
# context, about ten hooks a batch, so a callback costs a measurable share of a small
# model's update before it does anything (docs/benchmarks.md). Instead, the first Trainer of the
# process wraps, once per class, the few Lightning methods that bracket the phases:
#
# - ``_AutomaticOptimization.run`` / ``_ManualOptimization.run`` (one training batch:
#   training_step, backward, optimizer step): the step opens before the first batch of
#   an update and ends after the batch that changed the update count
#   (``trainer.global_step``, read from the loop: ``UPDATES_*``); forward opens with
#   the batch, and the fit's timer is put in bracket mode (``StepTimer.bracket``): the
#   backward patch ends that forward phase where backward begins. Under automatic
#   optimization it also opens the optimizer phase where backward ends
#   (``StepTimer.bracket_optimizer``), and the batch's end closes it when the batch
#   updated (an accumulating batch's is dropped), so it holds the update only (with
#   Lightning's gradient clipping and ``on_before_optimizer_step``), and torch's
#   optimizer step hooks are taken out for the fit: two Python calls fewer per
#   update. Under manual optimization those hooks time it, and backward restarts an
#   open optimizer phase. No wrapper of Lightning's own backward or closure is needed;
# - ``_TrainingEpochLoop.run`` (one epoch): a step never spans two epochs;
# - ``_EvaluationLoop.run`` / ``_PredictionLoop.run``: hooks off while they run (sanity
#   check, validation, test, predict are not training steps);
# - ``Trainer.fit``: starts TraceML, picks the trainer whose batches are traced, and
#   closes a step left open when ``fit()`` returns or raises.
#
# Each wrapper costs a call and a global read when nothing is traced (outside ``fit``,
# after a failure, or a trainer that carries an explicit TraceMLCallback, which then
# does the tracing). Only ranks started by ``traceml run`` install them.


class _ZeroCode:
    """The zero-code attach's state: one traced ``fit()`` at a time per process."""

    def __init__(self) -> None:
        self.driver = StepDriver()
        self.guard = HookGuard(FRAMEWORK, self._abandon)
        # The trainer whose training batches are traced; None: every wrapper passes through.
        self.trainer: Any = None
        # The optimizer updates counted at the end of the fit's last batch (UPDATES_*):
        # what the next batch moves, if it ends an update.
        self.updates = 0
        # The traced fit's model, taken at its first training batch (None: not yet).
        self.model: Any = None
        # The timer whose bracket this fit turned on (StepTimer.bracket).
        self.bracketed: StepTimer | None = None
        # Whether this fit took torch's optimizer step hooks out (bracket_optimizer).
        self.optimizer_hooks_out = False

    def _abandon(self) -> None:
        self.trainer = None
        self.fit_ended()
        self.driver.abandon()

    def _fit_model(self, trainer: Any) -> Any:
        # The strategy's model is the DDP wrapper under DDP: its forward runs the
        # training_step, and it names the strategy in runtime_environment.
        model = getattr(trainer.strategy, "model", None)
        if model is None:
            model = trainer.lightning_module
        automatic = bool(getattr(trainer.lightning_module, "automatic_optimization", False))
        if automatic:
            # The forward phase is bracketed here, from the batch's start to backward;
            # hooks on the model would time the training_step a second time, nested,
            # and slow every call of it, traced or not. (Manual optimization keeps
            # them: forwards after a manual_backward are outside the bracket.)
            forward_timed_elsewhere(model)
        self.model = model
        timer = active()
        if timer is not None:
            timer.bracket = True
            self.bracketed = timer
            # Backward's end opens the phase: without the backward patch the hooks
            # time it (from the update's start).
            timed = automatic and timer.auto_backward and timer.auto_optimizer
            if timed and suspend_optimizer_hooks():
                self.optimizer_hooks_out = True
                timer.bracket_optimizer = True
        return model

    def fit_ended(self) -> None:
        """The traced fit is over: its model is forgotten, its timer's bracket is off and
        torch's optimizer step hooks are back."""
        self.model = None
        timer = self.bracketed
        self.bracketed = None
        if timer is not None:
            timer.bracket = timer.bracket_optimizer = False
        if self.optimizer_hooks_out:
            self.optimizer_hooks_out = False
            resume_optimizer_hooks()

    def close(self, where: str, exc: BaseException | None) -> None:
        """End the open step (as ``with trace_step`` ends when ``exc`` is raised in it)."""
        try:
            driver = self.driver
            driver.resume()
            driver.close_forward()
            driver.end(exc)
        except Exception as error:
            self.guard.fail(where, error)


_ZERO = _ZeroCode()
# (class, attribute, original) of every wrapped method, for _uninstall.
_WRAPPED: list[tuple[Any, str, Any]] = []
_INSTALLED: set[str] = set()


# What ``trainer.global_step`` reads (it counts optimizer updates), read from the loop
# that runs the batch: one C call, where the property makes five Python calls
# (trainer, epoch loop, module, progress) on every read.
UPDATES_AUTOMATIC = "optim_progress.optimizer.step.total.completed"
UPDATES_MANUAL = "optim_step_progress.total.completed"


def _wrap_batch(original: Callable[..., Any], updates_at: str) -> Callable[..., Any]:
    updates = operator.attrgetter(updates_at)

    @functools.wraps(original)
    def run(*args: Any, **kwargs: Any) -> Any:
        # (loop, ...) taken as one tuple: the call passes it on as it came. The batch's
        # start and end are inline, not methods of _ZeroCode: a frame less each.
        zero = _ZERO
        trainer = zero.trainer
        loop = args[0]
        if trainer is None or loop.trainer is not trainer:
            return original(*args, **kwargs)
        try:
            # The step opens unless one is (an accumulating update), and forward opens:
            # the timer's bracket ends it where backward begins, the backward patch's
            # boundary (without that patch, forward is not timed).
            model = zero.model
            if model is None:
                model = zero._fit_model(trainer)
                zero.updates = updates(loop)  # later, read at each batch's end only
            driver = zero.driver
            driver.begin(model)
            timer = active()
            if timer is not None and driver.current is not None and timer.auto_backward:
                timer.open(timer.fwd)
        except Exception as exc:
            zero.guard.fail("a training batch", exc)
        try:
            result = original(*args, **kwargs)
        except BaseException as exc:
            # The user's exception propagates unchanged; the step is discarded.
            zero.close("a training batch", exc)
            raise
        try:
            # Forward closes if still open (a training_step without backward); the step
            # ends if the batch moved the update count (an accumulating batch leaves it
            # as it was, and its step open for the next batch). The optimizer phase
            # that backward's end opened (bracket_optimizer) closes with an update.
            count = updates(loop)
            timer = active()
            if timer is not None:
                if timer.fwd.depth > 0:
                    timer.fwd.depth = 1
                    timer.close(timer.fwd, FORWARD)
                opt = timer.opt
                if opt.depth > 0 and timer.bracket_optimizer:
                    if count != zero.updates:
                        opt.depth = 1
                        timer.close(opt, OPTIMIZER_STEP)
                    else:
                        opt.depth = 0  # an accumulating batch: no update ran
            if count != zero.updates:
                zero.updates = count
                zero.driver.end()
        except Exception as exc:
            zero.guard.fail("a training batch", exc)
        return result

    return run


def _wrap_epoch(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        zero = _ZERO
        if zero.trainer is not None and self.trainer is zero.trainer:
            # An epoch whose last batches did not update (manual optimization).
            zero.close("the end of an epoch", None)
        return result

    return run


def _wrap_evaluation(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        guard = _ZERO.guard
        if guard.failed:
            return original(self, *args, **kwargs)
        # Its own driver: validate()/predict() may run outside fit(); the hooks are off
        # while it runs, and what was off stays off.
        driver = StepDriver()
        guard.run("an evaluation loop", driver.pause)
        try:
            return original(self, *args, **kwargs)
        finally:
            guard.run("an evaluation loop", driver.resume)

    return run


def _has_explicit_callback(trainer: Any) -> bool:
    return any(isinstance(c, TraceMLCallback) for c in getattr(trainer, "callbacks", ()))


def _wrap_fit(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        zero = _ZERO
        previous = zero.trainer
        traced = False
        if not zero.guard.failed:
            try:
                # A trainer given TraceMLCallback is traced by that callback alone.
                traced = not _has_explicit_callback(self)
                if traced:
                    zero.driver.start()
            except Exception as exc:
                traced = False
                zero.guard.fail("Trainer.fit", exc)
        zero.trainer = self if traced else None
        zero.fit_ended()  # this fit's model is taken at its first training batch
        try:
            result = original(self, *args, **kwargs)
        except BaseException as exc:
            if traced:
                zero.close("Trainer.fit", exc)
            zero.fit_ended()
            if not zero.guard.failed:
                zero.trainer = previous
            raise
        if traced:
            zero.close("Trainer.fit", None)
        zero.fit_ended()
        if not zero.guard.failed:
            zero.trainer = previous
        return result

    return fit


def _targets(package: str) -> list[tuple[str, str, str, Callable[..., Any]]]:
    """(module, class, method, wrapper factory) of what the zero-code attach wraps."""
    return [
        (f"{package}.trainer.trainer", "Trainer", "fit", _wrap_fit),
        (
            f"{package}.loops.optimization.automatic",
            "_AutomaticOptimization",
            "run",
            functools.partial(_wrap_batch, updates_at=UPDATES_AUTOMATIC),
        ),
        (
            f"{package}.loops.optimization.manual",
            "_ManualOptimization",
            "run",
            functools.partial(_wrap_batch, updates_at=UPDATES_MANUAL),
        ),
        (f"{package}.loops.training_epoch_loop", "_TrainingEpochLoop", "run", _wrap_epoch),
        (f"{package}.loops.evaluation_loop", "_EvaluationLoop", "run", _wrap_evaluation),
        (f"{package}.loops.prediction_loop", "_PredictionLoop", "run", _wrap_evaluation),
    ]


def _install(package: str) -> None:
    """Wrap the methods of ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)
    once per process; all or nothing (a missing class leaves everything unwrapped)."""
    if package in _INSTALLED:
        return
    plan = []
    for module_name, class_name, method, factory in _targets(package):
        cls = getattr(importlib.import_module(module_name), class_name)
        original = cls.__dict__[method]
        if not callable(original):
            raise TypeError(f"{module_name}.{class_name}.{method} is not a function")
        plan.append((cls, method, original, factory))
    for cls, method, original, factory in plan:
        wrapper = factory(original)
        wrapper.__traceml_wrapped__ = True
        setattr(cls, method, wrapper)
        _WRAPPED.append((cls, method, original))
    _INSTALLED.add(package)


def _uninstall() -> None:
    """Restore every wrapped method (tests)."""
    while _WRAPPED:
        cls, method, original = _WRAPPED.pop()
        setattr(cls, method, original)
    _INSTALLED.clear()
    _ZERO.trainer = None


def _package_of(trainer_module: str) -> str:
    return trainer_module.removesuffix(".trainer.trainer")


def _wrap_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """``Trainer.__init__`` under ``traceml run``: the first trainer installs the wraps
    (Lightning is fully imported by then; the import hook runs while it is not)."""
    package = _package_of(original.__module__)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        if package not in _INSTALLED and not _ZERO.guard.failed:
            _ZERO.guard.run("Trainer.__init__", lambda: _install(package))

    __init__.__traceml_wrapped__ = True  # type: ignore[attr-defined]
    return __init__
