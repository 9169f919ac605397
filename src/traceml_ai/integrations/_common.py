"""What the framework integrations share: one traced step driven by callbacks, and the
guard that keeps an integration's own failure from reaching training.

A framework calls us at points of its loop (HF ``on_step_begin``/``on_step_end``,
Lightning ``on_train_batch_start``/``on_train_batch_end``, Accelerate's
``accumulate``); :class:`StepDriver` turns those into one ``trace_step`` per optimizer
update, so the micro-batches of gradient accumulation fold into the step that ends
with the update.
"""

from __future__ import annotations

import atexit
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, ClassVar

import traceml_ai as traceml
from traceml_ai.rank import (
    DATALOADER_NEXT,
    FORWARD,
    StepContext,
    StepTimer,
    activate,
    active,
    is_running,
)


def say(message: str) -> None:
    """One ``traceml:`` line on stderr."""
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def not_installed(module: str, needs: str, extra: str, exc: ImportError | None) -> ImportError:
    """The ImportError an integration module raises when its framework cannot be imported:
    ``traceml_ai.integrations.<module>`` needs ``needs`` (why: ``exc``), from ``extra``."""
    return ImportError(
        f"traceml_ai.integrations.{module} needs {needs}, which is not installed "
        f"({exc}). Install it with: pip install 'traceml-ai[{extra}]'"
    )


class HookGuard:
    """Runs integration hooks so that none of their exceptions reaches the framework.

    The first failure is reported once on stderr; every failure is counted in
    ``errors``. After a failure the integration is off for the rest of the run
    (``failed``): its state may no longer match the framework's loop, and a wrong
    step is worse than none.
    """

    def __init__(self, framework: str, on_failure: Callable[[], None]) -> None:
        self.framework = framework
        self.errors = 0
        self.failed = False
        self._on_failure = on_failure

    def run(self, hook: str, fn: Callable[[], object]) -> None:
        """Call ``fn``; an ``Exception`` from it is caught, counted and reported once."""
        if self.failed:
            return
        try:
            fn()
        except Exception as exc:
            self.fail(hook, exc)

    def fail(self, hook: str, exc: Exception) -> None:
        """What :meth:`run` does when its ``fn`` raised ``exc``: for hot paths that catch
        their own exceptions rather than pay for a closure per call."""
        self.errors += 1
        if self.failed:
            return
        self.failed = True
        say(
            f"the {self.framework} integration failed in {hook} ({exc!r}); TraceML "
            "stops tracing this run's steps and training continues"
        )
        try:
            self._on_failure()
        except Exception:
            self.errors += 1


class GuardedCallback:
    """What a framework's callback class takes first in its bases: one
    :class:`StepDriver` (``_driver``) and its :class:`HookGuard` (``_guard``).

    Every hook catches its own exceptions: the first is reported once as a
    ``traceml:`` line, ``hook_errors`` counts them, and the callback is then off for
    the run; training is never interrupted by it.
    """

    framework: ClassVar[str]
    """The framework's name in the guard's line."""

    def __init__(self) -> None:
        super().__init__()
        self._driver = StepDriver()
        self._guard = HookGuard(self.framework, self._driver.abandon)

    @property
    def hook_errors(self) -> int:
        """How many of this callback's hooks raised (each was caught)."""
        return self._guard.errors


class StepDriver:
    """One open ``trace_step`` at a time, begun and ended by framework hooks."""

    def __init__(self) -> None:
        # The open traced step (None: none).
        self.current: AbstractContextManager[None] | None = None
        # The last step context, entered again for the next step of the same model
        # and timer (one object and two calls less per step than trace_step()).
        self._context: StepContext | None = None
        self._paused: StepTimer | None = None
        # (step, perf_counter_ns) when pause() found a step open, else None.
        self._paused_at: tuple[int, int] | None = None
        self._atexit = False

    def start(self) -> None:
        """Training begins: start TraceML (no-op when running, off or disabled) and close
        a step an earlier loop left open.

        Started here rather than at the first step, so the first step's DataLoader
        waits, fetched before it begins, are measured.
        """
        if not is_running():
            # Not init() again when running: a script's own init(mode=...) would get a
            # notice that this init() (auto) is ignored.
            traceml.init()
        self.end()

    @property
    def open(self) -> bool:
        """Whether a step is open."""
        return self.current is not None

    def begin(self, model: object | None) -> bool:
        """Open a step (auto-initializes TraceML under ``traceml run``); nothing if one is
        open. Whether a step began now."""
        if self.current is not None:
            return False
        step: AbstractContextManager[None]
        context = self._context
        if context is not None and context.reusable_for(active(), model):
            step = context
        else:
            step = traceml.trace_step(model)
            self._context = step if isinstance(step, StepContext) else None
        step.__enter__()
        self.current = step
        if not self._atexit:
            # Registered after traceml.init's shutdown, so it runs first (atexit is
            # LIFO): a step left open by an exception that escaped the script is
            # closed before the final flush.
            self._atexit = True
            atexit.register(self._end_at_exit)
        return True

    def end(self, exc: BaseException | None = None) -> None:
        """Close the open step, if any.

        ``exc`` is the exception that ended training inside it: the step then ends as
        ``with trace_step(...)`` ends when its body raises.
        """
        step = self.current
        if step is None:
            return
        self.current = None
        if exc is None:
            step.__exit__(None, None, None)
        else:
            step.__exit__(type(exc), exc, exc.__traceback__)

    def _end_at_exit(self) -> None:
        # A step still open at exit was interrupted by an exception that escaped the
        # script (the interpreter has printed it and kept it in sys.last_value).
        last = getattr(sys, "last_value", None)
        self.end(last if isinstance(last, BaseException) else None)

    def open_forward(self) -> None:
        """Start the forward phase of the open step (nested hook calls count once)."""
        timer = active()
        if timer is not None and self.current is not None:
            timer.open(timer.fwd)

    def close_forward(self) -> None:
        """End the forward phase opened by :meth:`open_forward`, if it is still open."""
        timer = active()
        if timer is not None and timer.fwd.depth > 0:
            # Inner forward hooks close their own levels; one that did not (a forward
            # that raised without always_call) must not keep the phase open.
            timer.fwd.depth = 1
            timer.close(timer.fwd, FORWARD)

    def restart_optimizer(self) -> None:
        """Start the open optimizer phase now (its closure has run forward and backward)."""
        timer = active()
        if timer is not None:
            timer.restart(timer.opt)

    def pause(self) -> None:
        """Stop every hook from reporting (an evaluation loop runs); idempotent.

        A step open meanwhile (an evaluation between the batches of an accumulating
        update: Lightning's ``val_check_interval`` is counted in batches) leaves the
        paused time out of its duration (:meth:`resume`)."""
        timer = active()
        if timer is not None:
            self._paused = timer
            self._paused_at = (timer.step, time.perf_counter_ns()) if timer.in_step else None
            activate(None)

    def resume(self) -> None:
        """Undo :meth:`pause`; nothing if TraceML was shut down or failed meanwhile."""
        timer = self._paused
        paused_at = self._paused_at
        self._paused = self._paused_at = None
        if timer is not None and timer.enabled and active() is None:
            activate(timer)
            if paused_at is not None and paused_at[0] == timer.step:
                timer.leave_out(time.perf_counter_ns() - paused_at[1])

    @staticmethod
    def discard_dataloader_waits() -> None:
        """Forget DataLoader waits since the last step ended (they were an evaluation's)."""
        timer = active()
        if timer is not None:
            timer.discard_outside(DATALOADER_NEXT)

    def abandon(self) -> None:
        """After a failed hook: close what is open, resume hooks, never raise."""
        try:
            self.resume()
        finally:
            self.end()


def record_batch_tokens(batch: Any) -> None:
    """Add a batch's tokens to the open traced step: ``attention_mask.sum()`` when the
    batch has an ``attention_mask``, else ``input_ids.numel()``; nothing for another
    batch. A sum on an accelerator is read when the step's item is built, so the
    training thread never waits for the device here."""
    timer = active()
    if timer is None or not timer.enabled or not timer.in_step:
        return
    get = getattr(batch, "get", None)
    if not callable(get):
        return
    try:
        mask = get("attention_mask")
        ids = get("input_ids") if mask is None else None
    except Exception:
        return
    if mask is not None and hasattr(mask, "sum"):
        total = mask.sum()
        if getattr(getattr(total, "device", None), "type", "cpu") == "cpu":
            timer.record_tokens(int(total))
        else:
            timer.record_tokens_later(total)
    elif ids is not None and hasattr(ids, "numel"):
        timer.record_tokens(int(ids.numel()))
