"""The backward patch's bracket rules (``StepTimer.bracket``, Lightning's zero-code attach):
forward, opened at the batch's start, ends where backward begins; the optimizer phase,
opened by the optimizer's pre-hook before the closure ran forward and backward, restarts
where backward ends; with ``bracket_optimizer`` (the hooks out) it opens there. Runs over
both timer cores (conftest)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from traceml_ai.rank._patches import phase_hooks
from traceml_ai.rank._timing import event_names, step_timer
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing import FakeCuda

WORK_S = 0.03


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


@pytest.fixture
def timer() -> Iterator[step_timer.StepTimer]:
    timer = step_timer.StepTimer(RecordingSink(), FakeCuda(available=False), print, print)
    phase_hooks.activate(timer)
    yield timer
    phase_hooks.activate(None)


def _ms(timer: step_timer.StepTimer) -> dict[str, float]:
    (item,) = timer._sink.items("step_time")  # type: ignore[attr-defined]
    return {name: by_device["cpu"]["cpu_ms"] for name, by_device in item["events"].items()}


def _closure_step(timer: step_timer.StepTimer, backward: Any) -> None:
    """One Lightning update: forward opens with the batch, the optimizer's pre-hook
    opens its phase, the closure runs forward then backward, then the update."""
    timer.begin(None)
    timer.open(timer.fwd)  # the batch starts (the zero-code attach)
    timer.open(timer.opt)  # the optimizer's pre-hook, before the closure
    _busy(WORK_S)  # the closure's training_step
    backward()
    _busy(WORK_S / 3)  # the update itself
    timer.close(timer.opt, event_names.OPTIMIZER_STEP)  # the post-hook
    timer.close(timer.fwd, event_names.FORWARD)  # the batch ends: no-op when already closed
    timer.end()


def test_in_bracket_mode_backward_ends_forward_and_restarts_the_optimizer(
    timer: step_timer.StepTimer,
) -> None:
    timer.bracket = True
    backward = phase_hooks._timed_backward(lambda: _busy(WORK_S))
    _closure_step(timer, backward)
    ms = _ms(timer)
    assert timer.fwd.depth == timer.opt.depth == timer.bwd.depth == 0
    assert ms[event_names.FORWARD] >= WORK_S * 1e3 * 0.9
    assert ms[event_names.BACKWARD] >= WORK_S * 1e3 * 0.9
    # The update only: neither the closure's forward nor its backward.
    assert ms[event_names.OPTIMIZER_STEP] < WORK_S * 1e3 * 0.9
    # The phases do not overlap.
    phases = ms[event_names.FORWARD] + ms[event_names.BACKWARD] + ms[event_names.OPTIMIZER_STEP]
    assert phases <= ms[event_names.STEP_TIME]


def test_outside_bracket_mode_backward_leaves_other_phases_alone(
    timer: step_timer.StepTimer,
) -> None:
    backward = phase_hooks._timed_backward(lambda: _busy(WORK_S))
    _closure_step(timer, backward)
    ms = _ms(timer)
    # A hand-written loop's phases: forward and the optimizer span what ran in them.
    assert ms[event_names.FORWARD] >= 2 * WORK_S * 1e3 * 0.9
    assert ms[event_names.OPTIMIZER_STEP] >= 2 * WORK_S * 1e3 * 0.9


def test_in_bracket_mode_a_backward_that_raises_still_ends_and_restarts(
    timer: step_timer.StepTimer,
) -> None:
    timer.bracket = True

    def failing() -> None:
        _busy(WORK_S)
        raise RuntimeError("backward failed")

    backward = phase_hooks._timed_backward(failing)
    timer.begin(None)
    timer.open(timer.fwd)
    timer.open(timer.opt)
    with pytest.raises(RuntimeError, match="backward failed"):
        backward()
    assert timer.fwd.depth == timer.bwd.depth == 0
    assert timer.opt.depth == 1
    timer.close(timer.opt, event_names.OPTIMIZER_STEP)
    timer.end()
    ms = _ms(timer)
    assert ms[event_names.OPTIMIZER_STEP] < WORK_S * 1e3 * 0.9


def test_bracket_mode_without_an_open_forward_or_optimizer_only_times_backward(
    timer: step_timer.StepTimer,
) -> None:
    """A micro-batch of gradient accumulation: the closure runs without the optimizer."""
    timer.bracket = True
    backward = phase_hooks._timed_backward(lambda: _busy(WORK_S))
    timer.begin(None)
    backward()
    timer.end()
    ms = _ms(timer)
    assert set(ms) == {event_names.BACKWARD, event_names.STEP_TIME}
    assert timer.opt.depth == 0


def test_a_backward_on_another_thread_leaves_the_steps_phases_alone(
    timer: step_timer.StepTimer,
) -> None:
    timer.bracket = True
    backward = phase_hooks._timed_backward(lambda: None)
    timer.begin(None)
    timer.open(timer.fwd)
    timer.open(timer.fwd)  # the bracket's level and an inner forward's
    timer.open(timer.opt)
    worker = threading.Thread(target=backward)
    worker.start()
    worker.join()
    assert (timer.fwd.depth, timer.bwd.depth, timer.opt.depth) == (2, 0, 1)
    timer.close(timer.opt, event_names.OPTIMIZER_STEP)
    timer.close(timer.fwd, event_names.FORWARD)
    timer.close(timer.fwd, event_names.FORWARD)
    timer.end()
    assert event_names.BACKWARD not in _ms(timer)


def test_with_bracket_optimizer_backward_end_opens_the_optimizer_phase(
    timer: step_timer.StepTimer,
) -> None:
    """Lightning's automatic optimization, its optimizer hooks out: the phase opens where
    backward ends, a second backward restarts it, and the batch's end closes it."""
    timer.bracket = timer.bracket_optimizer = True
    backward = phase_hooks._timed_backward(lambda: _busy(WORK_S))
    timer.begin(None)
    timer.open(timer.fwd)
    _busy(WORK_S)  # the training_step
    backward()
    assert timer.opt.depth == 1
    _busy(WORK_S)  # more of the closure before a second backward
    backward()
    assert timer.opt.depth == 1
    _busy(WORK_S / 3)  # the update itself
    timer.close(timer.opt, event_names.OPTIMIZER_STEP)  # the batch ends with an update
    timer.end()
    ms = _ms(timer)
    assert WORK_S / 3 * 1e3 * 0.9 <= ms[event_names.OPTIMIZER_STEP] < WORK_S * 1e3 * 0.9
    assert ms[event_names.BACKWARD] >= 2 * WORK_S * 1e3 * 0.9
    phases = ms[event_names.FORWARD] + ms[event_names.BACKWARD] + ms[event_names.OPTIMIZER_STEP]
    assert phases <= ms[event_names.STEP_TIME]


def test_with_bracket_optimizer_off_by_config_backward_opens_nothing(
    timer: step_timer.StepTimer,
) -> None:
    """``auto_optimizer`` off (``init(mode="manual")``): the optimizer phase stays untimed."""
    timer.bracket = timer.bracket_optimizer = True
    timer.auto_optimizer = False
    backward = phase_hooks._timed_backward(lambda: None)
    timer.begin(None)
    backward()
    assert timer.opt.depth == 0
    timer.end()
    assert event_names.OPTIMIZER_STEP not in _ms(timer)
