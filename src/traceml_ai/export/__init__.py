"""Live export: records of the selected streams, from rank batches to an exporter.

Public API:

- :func:`start_export` / :class:`ExportPipeline`: what the aggregator runs.
- :class:`Exporter`, :class:`ExportContext`, :class:`ExportSummary`: the protocol a
  custom exporter (``exporter: my_pkg.my_module:make_exporter``) implements;
  :class:`ExportResult`, :class:`ExporterError`: what ``export`` may return or raise;
  :class:`LineExporter`, :class:`EncodedLines`, :func:`export_input_of`: the declared
  fast path (``export_input = "encoded_lines"``) that the JSONL exporter takes.
- :class:`InMemoryExporter`, :func:`make_in_memory_exporter`, :func:`capture_export`:
  an exporter for tests, TraceML's and yours.
- :class:`JsonlExporter`: the built-in exporter.
- :class:`ExportStats`: the worker's counts.
- finalization (the aggregator's and the launcher's): :class:`RankOutcome`,
  :func:`write_finalization_warning` (``WARNING_FILE_NAME``), :func:`monitoring_lost`
  and :func:`monitoring_clause` (what the live views lost, in a sentence);
  :func:`batch_streams_for` (the wire streams a run's file streams need).
"""

from traceml_ai.export._builder import BuildResult, RecordBuilder, batch_streams_for
from traceml_ai.export._custom import ExporterStartFailure, create_exporter, load_exporter_factory
from traceml_ai.export._encoded import EncodedLines
from traceml_ai.export._finalize import (
    WARNING_FILE_NAME,
    RankOutcome,
    WarningWriteError,
    monitoring_clause,
    monitoring_lost,
    write_finalization_warning,
)
from traceml_ai.export._jsonl import JsonlExporter
from traceml_ai.export._memory import InMemoryExporter, capture_export, make_in_memory_exporter
from traceml_ai.export._pipeline import ExportPipeline, builder_for, start_export
from traceml_ai.export._protocol import (
    ExportContext,
    Exporter,
    ExporterError,
    ExporterFactory,
    ExportInput,
    ExportResult,
    ExportSummary,
    LineExporter,
    export_input_of,
)
from traceml_ai.export._worker import ExportStats, ExportWorker, max_queue_bytes_for

__all__ = [
    "WARNING_FILE_NAME",
    "BuildResult",
    "EncodedLines",
    "ExportContext",
    "ExportInput",
    "ExportPipeline",
    "ExportResult",
    "ExportStats",
    "ExportSummary",
    "ExportWorker",
    "Exporter",
    "ExporterError",
    "ExporterFactory",
    "ExporterStartFailure",
    "InMemoryExporter",
    "JsonlExporter",
    "LineExporter",
    "RankOutcome",
    "RecordBuilder",
    "WarningWriteError",
    "batch_streams_for",
    "builder_for",
    "capture_export",
    "create_exporter",
    "export_input_of",
    "load_exporter_factory",
    "make_in_memory_exporter",
    "max_queue_bytes_for",
    "monitoring_clause",
    "monitoring_lost",
    "start_export",
    "write_finalization_warning",
]
