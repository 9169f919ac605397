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

from tests.rank_helpers import TensorlessModel
from traceml_ai.rank._timing import event_names, step_timer
from traceml_ai.rank._timing.step_recorder import StepRecorder
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


def _tracked_growth(sender: RankSender, defer: bool, cuda: bool) -> tuple[int, int]:
    """(objects the collector tracks gained over STEPS traced steps, items waiting)."""
    recorder = StepRecorder(sender, encoded=sender)
    # "cuda" is faked (no GPU here): every phase records events that complete at once.
    backend = FakeCuda(model_device=0, auto_complete=True) if cuda else FakeCuda(available=False)
    timer = step_timer.StepTimer(recorder, backend, lambda model: None, lambda exc: None)
    timer.defer = defer
    model = TensorlessModel()

    def steps(n: int) -> None:
        for _ in range(n):
            timer.add_host(event_names.DATALOADER_NEXT, 1000)
            timer.begin(model)
            timer.open(timer.opt)  # a pair of CUDA events on "cuda"
            timer.close(timer.opt, event_names.OPTIMIZER_STEP)
            timer.end()
        timer.build_ended()

    steps(200)  # warm: pools filled
    assert timer.device == ("cuda:0" if cuda else "cpu")
    before = len(gc.get_objects())
    for _ in range(STEPS // 100):
        steps(100)
    # A young collection, as the interpreter runs many between two flushes: it stops
    # tracking tuples that hold only numbers, str and bytes, which are then never
    # promoted (the recorder keeps (step, encoded events)).
    gc.collect(0)
    return len(gc.get_objects()) - before, sender.pending_items


@pytest.mark.parametrize(
    ("defer", "cuda"),
    [(True, False), (False, False), (True, True)],
    ids=["built-by-the-sender", "inline", "cuda-steps"],
)
def test_steps_waiting_to_be_sent_hold_no_tracked_object(
    collector_off: None, defer: bool, cuda: bool
) -> None:
    # Never started: every item waits in the queue, as between two flushes.
    sender = RankSender(("127.0.0.1", 9), "token", {"rank": 0}, max_pending_items=100_000)
    grown, waiting = _tracked_growth(sender, defer, cuda)
    assert waiting == 2 * (STEPS + 200)  # step_time and step_memory, all kept
    # A handful of pooled objects at most, not a few per step.
    assert grown < 50, f"{grown} new tracked objects over {STEPS} steps"
    sender.close()
