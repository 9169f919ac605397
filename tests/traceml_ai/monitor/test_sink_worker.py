"""The live sinks' one worker (traceml_ai.monitor._sink_worker): its bound and drop
policy, an exporter that raises or hangs, its close budget, and a real fork's child.

The exporter here is a small recording one: the worker is the thing under test, and
the OTLP and tracker sinks built on it are tested against real receivers and real
tracker libraries in test_otlp.py and test_trackers.py.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence

import attrs
import orjson
import pytest

from traceml_ai.monitor._sink_worker import SENT, Outcome, SinkWorker


class Recorder:
    """Records each batch; ``gate`` (when set) holds every export until it opens;
    ``fail_first`` raises on the first batch; ``hang`` never returns (not even on
    abort)."""

    def __init__(
        self, *, gate: threading.Event | None = None, fail_first: bool = False, hang: bool = False
    ) -> None:
        self.batches: list[list[int]] = []
        self.gate = gate
        self.fail_first = fail_first
        self.hang = hang
        self.in_export = threading.Event()
        self.aborted = threading.Event()
        self.finished = False
        self.intervals: list[bool] = []

    def begin(self) -> None:
        pass

    def on_interval(self, final: bool) -> Sequence[int]:
        self.intervals.append(final)
        return ()

    def ready(self, final: bool) -> bool:
        return True

    def export(self, batch: Sequence[int]) -> Outcome:
        self.in_export.set()
        if self.hang:
            threading.Event().wait()  # a receiver that never answers
        if self.gate is not None:
            self.gate.wait()
        if self.fail_first and not self.batches:
            self.batches.append([])
            raise ConnectionError("refused\nby the receiver")
        self.batches.append(list(batch))
        return SENT

    def finish(self) -> None:
        self.finished = True

    def abort(self) -> None:
        self.aborted.set()


def _worker(
    exporter: Recorder, lines: list[str], *, max_items: int = 4, batch_size: int = 1
) -> SinkWorker[int]:
    worker: SinkWorker[int] = SinkWorker(
        "test",
        exporter,
        max_items=max_items,
        max_size=1000,
        batch_size=batch_size,
        size_of=lambda n: 10,
        report_failure=lines.append,
    )
    worker.start()
    return worker


def test_a_full_queue_drops_the_newest_and_counts_them() -> None:
    gate = threading.Event()
    exporter = Recorder(gate=gate)
    lines: list[str] = []
    worker = _worker(exporter, lines, max_items=4)
    assert worker.put(0)
    assert exporter.in_export.wait(5)  # item 0 is in the exporter's hands
    accepted = [worker.put(n) for n in range(1, 9)]
    assert accepted == [True] * 4 + [False] * 4
    gate.set()
    counts = worker.close(5.0)
    assert [n for batch in exporter.batches for n in batch] == [0, 1, 2, 3, 4]
    assert counts.dropped == 4 * 10  # in the queue's size: items 5 to 8
    assert (counts.exported, counts.failed, counts.abandoned) == (50, 0, 0)
    assert not counts.timed_out and exporter.finished and exporter.intervals == [True]
    assert lines == []


def test_an_exporter_that_raises_is_one_line_and_the_worker_goes_on() -> None:
    exporter = Recorder(fail_first=True)
    lines: list[str] = []
    worker = _worker(exporter, lines)
    worker.put(1)
    deadline = time.monotonic() + 5
    while not exporter.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    for n in (2, 3):
        worker.put(n)
    counts = worker.close(5.0)
    assert exporter.batches == [[], [2], [3]]
    assert (counts.exported, counts.failed, counts.dropped) == (20, 10, 0)
    assert lines == ["ConnectionError: refused by the receiver"]


def test_an_exporter_that_hangs_costs_the_close_budget_and_counts_what_was_left() -> None:
    exporter = Recorder(hang=True)
    lines: list[str] = []
    worker = _worker(exporter, lines, max_items=100)
    worker.put(1)
    assert exporter.in_export.wait(5)
    for n in range(2, 6):
        worker.put(n)
    started = time.monotonic()
    counts = worker.close(1.0)
    took = time.monotonic() - started
    assert took < 1.2, took
    assert exporter.aborted.is_set() and worker.thread.is_alive()
    assert counts.timed_out
    assert counts.abandoned == 5 * 10  # the one in hand and the four queued
    assert (counts.exported, counts.failed) == (0, 0)
    assert not worker.put(6)  # after close: dropped, counted
    assert worker.close(1.0) == counts  # idempotent: the final counts


def test_woken_and_interval_work_runs_on_the_worker_and_its_items_are_exported() -> None:
    class Points(Recorder):
        def on_interval(self, final: bool) -> Sequence[int]:
            self.intervals.append(final)
            return [100 + len(self.intervals)]

    exporter = Points()
    worker: SinkWorker[int] = SinkWorker(
        "test", exporter, max_items=8, max_size=8, batch_size=1, interval_s=60.0,
        report_failure=lambda line: None,
    )  # fmt: skip
    worker.start()
    worker.wake()
    deadline = time.monotonic() + 5
    while not exporter.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    counts = worker.close(5.0)
    assert exporter.intervals == [False, True]
    assert exporter.batches == [[101], [102]]
    assert counts.exported == 2


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_gets_an_empty_queue_and_a_fresh_thread() -> None:
    gate = threading.Event()
    exporter = Recorder(gate=gate)
    lines: list[str] = []
    worker = _worker(exporter, lines, max_items=8)
    worker.put(0)
    assert exporter.in_export.wait(5)
    for n in (1, 2, 3):
        worker.put(n)  # queued in the parent while its thread is busy
    parent_thread = worker.thread
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: nothing of the parent's is sent from here
        try:
            started = time.monotonic()
            seen = {
                "queued": len(worker),
                "fresh_thread": worker.thread is not parent_thread,
                "alive": worker.thread.is_alive(),
                "put": worker.put(9),
                "counts": list(attrs.astuple(worker.close(5.0))),
                "close_s": time.monotonic() - started,
                "exported_here": sum(len(b) for b in exporter.batches),
            }
            os.write(write_end, orjson.dumps(seen))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as child_out:
        seen = orjson.loads(child_out.read())
    os.waitpid(pid, 0)
    assert seen["queued"] == 0 and seen["fresh_thread"] and not seen["alive"]
    assert seen["put"] is False
    assert seen["counts"] == [0, 0, 10, 0, False]  # only the child's own drop
    assert seen["close_s"] < 0.5
    assert seen["exported_here"] == 0  # the batch the parent's thread held never left
    gate.set()
    counts = worker.close(5.0)  # the parent's worker is untouched
    assert [n for batch in exporter.batches for n in batch] == [0, 1, 2, 3]
    assert counts.exported == 40 and counts.dropped == 0


def test_the_queue_takes_a_batch_by_size_and_counts_the_size_it_dropped() -> None:
    from traceml_ai._queue import BoundedBatchQueue

    @attrs.frozen
    class Sized:
        nbytes: int

    queue: BoundedBatchQueue[Sized] = BoundedBatchQueue(max_items=10, max_bytes=100)
    for size in (30, 30, 30, 50, 5):
        queue.put(Sized(size))
    with queue.cond:
        assert [s.nbytes for s in queue.take_batch(70)] == [30, 30]
        assert [s.nbytes for s in queue.take_batch(10)] == [30]  # the oldest, whatever its size
        assert queue.nbytes == 5 and len(queue) == 1
    assert (queue.dropped, queue.dropped_nbytes) == (1, 50)  # the 50 would pass 100
    queue.put(Sized(90))
    with queue.cond:
        queue.close()
    queue.put(Sized(7))
    with queue.cond:
        assert queue.clear() == 2
    assert (queue.dropped, queue.dropped_nbytes) == (4, 50 + 7 + 5 + 90)
