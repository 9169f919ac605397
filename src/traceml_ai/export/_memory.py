"""An exporter that keeps records in memory: for TraceML's tests and for users' tests.

Like structlog's ``capture_logs``: run the code under test with
``exporter="traceml_ai.export:make_in_memory_exporter"`` (or build an
:class:`InMemoryExporter` yourself and hand it to an ``ExportWorker``), then assert
on the typed records it received. :func:`capture_export` wraps the common in-process
case: it gives you the exporter that the next ``make_in_memory_exporter`` call
creates.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from traceml_ai import _fork
from traceml_ai.export._protocol import ExportContext, ExportSummary
from traceml_records.internal import STREAM_BY_CLASS

__all__ = ["InMemoryExporter", "capture_export", "make_in_memory_exporter"]


class InMemoryExporter:
    """Keeps every exported record, per stream, and the summary ``close`` received.

    Thread-safe: the export worker calls ``export``/``close`` from its thread while a
    test reads ``records``. ``context`` is the export context it was made for (None
    when built directly).
    """

    def __init__(self, context: ExportContext | None = None) -> None:
        self.context = context
        self._lock = threading.Lock()
        self._records: dict[str, list[Any]] = {}
        self._export_calls = 0
        self._closed_with: ExportSummary | None = None
        self._close_calls = 0

    def export(self, records: Sequence[Any]) -> None:
        """Keep ``records`` (one stream's, non-empty) under their stream's name."""
        if not records:
            return
        spec = STREAM_BY_CLASS.get(type(records[0]))
        stream = spec.name if spec is not None else type(records[0]).__name__
        with self._lock:
            self._records.setdefault(stream, []).extend(records)
            self._export_calls += 1

    def close(self, summary: ExportSummary) -> None:
        """Remember ``summary``; a second call is counted but changes nothing else."""
        with self._lock:
            self._close_calls += 1
            if self._closed_with is None:
                self._closed_with = summary

    @property
    def records(self) -> dict[str, list[Any]]:
        """A copy of the records received so far, per stream name, in arrival order."""
        with self._lock:
            return {stream: list(records) for stream, records in self._records.items()}

    def records_of(self, stream: str) -> list[Any]:
        """A copy of the records of ``stream`` received so far (empty if none)."""
        with self._lock:
            return list(self._records.get(stream, ()))

    @property
    def export_calls(self) -> int:
        """How many times ``export`` was called."""
        with self._lock:
            return self._export_calls

    @property
    def closed_with(self) -> ExportSummary | None:
        """The summary of the first ``close`` call, or None while not closed."""
        with self._lock:
            return self._closed_with

    @property
    def close_calls(self) -> int:
        """How many times ``close`` was called (the worker calls it once)."""
        with self._lock:
            return self._close_calls


_capture_lock = threading.Lock()
_capture_stack: list[list[InMemoryExporter]] = []


@_fork.on_fork_in_child
def _reset_capture_lock_in_child() -> None:
    # A parent thread may hold the lock at fork time; the child would wait forever.
    global _capture_lock
    _capture_lock = threading.Lock()


def make_in_memory_exporter(context: ExportContext) -> InMemoryExporter:
    """Exporter factory (``exporter="traceml_ai.export:make_in_memory_exporter"``).

    Inside :func:`capture_export` the new exporter is also handed to that block.
    """
    exporter = InMemoryExporter(context)
    with _capture_lock:
        if _capture_stack:
            _capture_stack[-1].append(exporter)
    return exporter


@contextmanager
def capture_export() -> Iterator[list[InMemoryExporter]]:
    """Collect the in-memory exporters that ``make_in_memory_exporter`` creates in the block.

    For in-process use (e.g. an aggregator started by the test): the yielded list
    holds every exporter made while the block runs, usually exactly one::

        with capture_export() as exporters:
            run_aggregator(exporter="traceml_ai.export:make_in_memory_exporter")
        assert exporters[0].records["step_time"]
    """
    captured: list[InMemoryExporter] = []
    with _capture_lock:
        _capture_stack.append(captured)
    try:
        yield captured
    finally:
        with _capture_lock:
            # By identity: list.remove() compares by value and every empty list is equal.
            for index, entry in enumerate(_capture_stack):
                if entry is captured:
                    del _capture_stack[index]
                    break
