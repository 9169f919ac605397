"""Traced steps leave nothing behind for the garbage collector.

Thousands of step items, phase dicts or recorded events kept alive between flushes
moved into the collector's oldest generation and brought on full collections of the
training process (~0.2 s each under Lightning: docs/benchmarks.md). These tests count
the objects the collector tracks, with real components: the timer, the recorder that
``summary()`` reads and a ``RankSender`` holding what waits to be sent.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from tests.rank_helpers import TensorlessModel, timer_steps
from traceml_ai.rank import _timing
from traceml_ai.rank._compat_summary import StepRecorder
from traceml_ai.testing import FakeCuda
from traceml_ai.transport import RankSender

STEPS = 2_000


@pytest.fixture
def collector_off() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _tracked_growth(sender: RankSender, defer: bool) -> tuple[int, int]:
    """(objects the collector tracks gained over STEPS traced steps, items waiting)."""
    recorder = StepRecorder(None)
    recorder.sink = sender
    timer = _timing.StepTimer(
        recorder, FakeCuda(available=False), lambda model: None, lambda exc: None
    )
    timer.defer = defer
    model = TensorlessModel()
    timer_steps(timer, 200, model)  # warm: pools filled
    timer.build_ended()
    before = len(gc.get_objects())
    for _ in range(STEPS // 100):
        timer_steps(timer, 100, model)
        timer.build_ended()
    # A young collection, as the interpreter runs many between two flushes: it stops
    # tracking tuples that hold only numbers, str and bytes, which are then never
    # promoted (the recorder keeps (step, encoded events)).
    gc.collect(0)
    return len(gc.get_objects()) - before, sender.pending_items


@pytest.mark.parametrize("defer", [True, False], ids=["built-by-the-sender", "inline"])
def test_steps_waiting_to_be_sent_hold_no_tracked_object(collector_off: None, defer: bool) -> None:
    # Never started: every item waits in the queue, as between two flushes.
    sender = RankSender(("127.0.0.1", 9), "token", {"rank": 0}, max_pending_items=100_000)
    grown, waiting = _tracked_growth(sender, defer)
    assert waiting == 2 * (STEPS + 200)  # step_time and step_memory, all kept
    # A handful of pooled objects at most, not a few per step.
    assert grown < 50, f"{grown} new tracked objects over {STEPS} steps"
    sender.close()
