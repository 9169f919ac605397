"""Helpers for testing code that uses TraceML, without a GPU and without ``traceml run``.

Public API:

- :class:`FakeCuda` / :class:`FakeNvml`: ``cuda_backend=`` and ``nvml_backend=`` for
  ``traceml_ai.init``, as strict as ``torch.cuda`` and NVML where TraceML depends on
  it (per-thread ``current_device``, events that complete only when the fake GPU gets
  there, ``elapsed_time`` that raises before that).
- :class:`ExportCapture`: ``sink=`` for ``traceml_ai.init``; shows the typed records
  and lines an export would write for what the training loop did.
- :class:`InMemoryExporter`, :func:`make_in_memory_exporter`, :func:`capture_export`:
  an exporter (``exporter="traceml_ai.export:make_in_memory_exporter"``) that keeps
  what the aggregator exports.
- :func:`reset`: TraceML back to its state at import, between tests.
- :func:`make_item`, :func:`make_batch`, :func:`make_records`, ...: wire items,
  batches and records valid under the schemas, deterministic, cheap.

See docs/testing.md.
"""

from __future__ import annotations

from traceml_ai.export import InMemoryExporter, capture_export, make_in_memory_exporter
from traceml_ai.rank.gpu import GpuReading
from traceml_ai.rank.sink import RecordingSink
from traceml_ai.testing._capture import ExportCapture
from traceml_ai.testing._cuda import FakeCuda, FakeCudaEvent, FakeCudaMisuse
from traceml_ai.testing._items import (
    BASE_TIMESTAMP_NS,
    BUILTIN_PHASES,
    OBSERVED_TIMESTAMP_NS,
    make_batch,
    make_batch_body,
    make_events,
    make_gpu_entry,
    make_identity,
    make_item,
    make_phase,
    make_record,
    make_records,
)
from traceml_ai.testing._nvml import FakeNvml, make_gpu_reading

__all__ = [
    "BASE_TIMESTAMP_NS",
    "BUILTIN_PHASES",
    "OBSERVED_TIMESTAMP_NS",
    "ExportCapture",
    "FakeCuda",
    "FakeCudaEvent",
    "FakeCudaMisuse",
    "FakeNvml",
    "GpuReading",
    "InMemoryExporter",
    "RecordingSink",
    "capture_export",
    "make_batch",
    "make_batch_body",
    "make_events",
    "make_gpu_entry",
    "make_gpu_reading",
    "make_identity",
    "make_in_memory_exporter",
    "make_item",
    "make_phase",
    "make_record",
    "make_records",
    "reset",
]


def reset() -> None:
    """Return TraceML to its state at import: shut down what ``init`` started (samplers,
    sender, hooks), forget the configuration, the run's counters and every warn-once
    flag, so the next ``init`` behaves as in a fresh process. Safe to call at any time,
    also when nothing was started."""
    # Imported here: traceml_ai.testing must stay importable without torch, and the
    # SDK module is only needed once a test resets.
    from traceml_ai.rank import reset_for_tests

    reset_for_tests()
