"""``StepDriver``, which turns framework hooks into traced steps, on a real runtime."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

import traceml_ai as traceml
from tests.rank_helpers import ENV_VARS, make_model, step_items
from traceml_ai.integrations._common import StepDriver
from traceml_ai.rank._runtime import sdk
from traceml_ai.rank._timing.event_names import STEP_TIME
from traceml_ai.rank.sink import RecordingSink


@pytest.fixture(autouse=True)
def _clean(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for name in (*ENV_VARS, "TRACEML_DISABLED", "TRACEML_SUMMARY_STEP_TIME_FILE"):
        monkeypatch.delenv(name, raising=False)
    sdk.reset_for_tests()
    yield
    sdk.reset_for_tests()


def _step(driver: StepDriver, model: object) -> object:
    driver.begin(model)
    context = driver.current
    driver.end()
    return context


def test_the_driver_reuses_its_step_context_and_follows_a_new_runtime() -> None:
    """One step context per model and running timer, entered again for each update
    (no object per update); a new model, or init() after shutdown(), gets a new one,
    and its steps go on from the earlier numbers into the new runtime's sink."""
    first_sink = RecordingSink()
    traceml.init(sink=first_sink, sampler_interval=60)
    driver = StepDriver()
    model, other = make_model(), make_model()
    first = _step(driver, model)
    assert first is not None and _step(driver, model) is first
    assert _step(driver, other) is not first
    traceml.shutdown()
    second_sink = RecordingSink()
    traceml.init(sink=second_sink, sampler_interval=60)
    third = _step(driver, other)
    assert third is not first and _step(driver, other) is third
    traceml.shutdown()
    assert [item["step"] for item in step_items(first_sink)] == [1, 2, 3]
    assert [item["step"] for item in step_items(second_sink)] == [4, 5]


def test_a_paused_driver_does_not_reuse_a_context_for_another_timer() -> None:
    """While an evaluation loop has the hooks off (no running timer) the driver makes
    its step with trace_step(), as before: a reused context could be a stale timer's."""
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    driver = StepDriver()
    model = make_model()
    first = _step(driver, model)
    driver.pause()
    paused = _step(driver, model)
    assert paused is not first and _step(driver, model) is not paused
    driver.resume()
    assert _step(driver, model) is not paused
    traceml.shutdown()
    assert [item["step"] for item in step_items(sink)] == [1, 2, 3, 4]


def _step_ms(item: dict[str, Any]) -> float:
    events = item["events"][STEP_TIME]
    (by_device,) = events.values()
    ms: float = by_device["cpu_ms"]
    return ms


@pytest.mark.parametrize("evaluation_inside_the_step", [True, False])
def test_an_evaluation_inside_an_open_step_is_left_out_of_its_time(
    evaluation_inside_the_step: bool,
) -> None:
    """Lightning runs validation every ``val_check_interval`` batches, which may fall
    between the batches of an accumulating update: the paused time is not the step's.
    Paused between steps, nothing is shifted."""
    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    driver = StepDriver()
    evaluation = StepDriver()  # the evaluation loop's own driver (zero-code Lightning)
    model = make_model()
    driver.begin(model)
    if not evaluation_inside_the_step:
        driver.end()
    evaluation.pause()
    time.sleep(0.3)
    evaluation.resume()
    if not evaluation_inside_the_step:
        driver.begin(model)
    time.sleep(0.02)
    driver.end()
    traceml.shutdown()
    items = step_items(sink)
    assert [item["step"] for item in items] == [1] if evaluation_inside_the_step else [1, 2]
    assert 20 <= _step_ms(items[-1]) < 250


def test_a_step_begun_while_the_hooks_were_paused_keeps_its_whole_time() -> None:
    """resume() leaves the pause out of the step pause() found open only: one that
    ended meanwhile, and a step begun after it, are not shifted."""
    from traceml_ai.rank._patches import phase_hooks

    sink = RecordingSink()
    traceml.init(sink=sink, sampler_interval=60)
    model = make_model()
    driver = StepDriver()
    driver.begin(model)
    timer = phase_hooks.active()
    assert timer is not None
    evaluation = StepDriver()
    evaluation.pause()
    time.sleep(0.3)
    driver.end()  # the step pause() found ends, and another begins, while paused
    timer.begin(model)
    evaluation.resume()
    time.sleep(0.02)
    timer.end()
    traceml.shutdown()
    items = step_items(sink)
    assert [item["step"] for item in items] == [1, 2]
    assert _step_ms(items[0]) >= 300
    assert 20 <= _step_ms(items[1]) < 250
