"""What ``traceml_ai`` uses of ``traceml_records`` beyond its public names.

The one declared surface between the two packages: the producer (rank, transport,
aggregator, exporter) builds and checks records with these, and imports no private
module of ``traceml_records`` directly. Everything here is generated from the
schemas or written once against them; it is internal to TraceML (no stability
promise to other users — they have ``traceml_records``'s public names).

- wire items: the typed dicts a rank sends and their stream tables (generated);
- record building: the loaders and encoder plans per record class (generated), the
  line and batch encoders, the stream of a record class;
- checks: the rules a line must satisfy beyond its types (``_rules``);
- the one scan of the export files (``FileScan``: a file, from where the last read
  stopped, to the columns or objects of its valid lines and one ``FileState``; the
  ``REASONS`` a line is not taken, the one vocabulary of every report; ``Layout``,
  ``RowsLayout`` and ``LINE``: which columns), and the line primitives under it
  (``scan_lines``, ``LineSplitter``, ``classify_line``, ``closing_of``, ``is_closing``:
  complete lines, the partial last line, closing lines);
- the check plans (``CHECKS``, generated: each stream's fields, kinds, bounds, key and
  rules), and :func:`load_extension`, the one place that chooses a C
  extension or its pure-Python twin (``TRACEML_PURE_PYTHON``).
"""

from traceml_records._codec import (
    dumps_line,
    dumps_lines,
    encode_batch,
    encode_items,
    split_batch,
)
from traceml_records._errors import Path as FieldPath
from traceml_records._extensions import PURE_PYTHON_ENV
from traceml_records._extensions import load as load_extension
from traceml_records._generated.checks import CHECKS
from traceml_records._generated.records import (
    ENCODER_CONDITIONS,
    ENCODER_PLANS,
    ITEM_LOADERS,
    LOADERS,
    Flag,
)
from traceml_records._generated.wire import (
    BATCH_STREAMS,
    FILE_STREAMS_OF_BATCH,
    WIRE_STREAMS,
    CollectivesItem,
    ParallelCoordinateItem,
    PhaseTimingItem,
    ProcessItem,
    RuntimeEnvironmentItem,
    StdoutStderrItem,
    StepMemoryItem,
    StepTimeItem,
    SystemGpuItem,
    SystemItem,
)
from traceml_records._lines import (
    BLOCK_BYTES,
    CLOSING_KEY,
    LineKind,
    LineSplitter,
    closing_of,
    is_closing,
)
from traceml_records._lines import classify as classify_line
from traceml_records._lines import scan as scan_lines
from traceml_records._registry import STREAM_BY_CLASS
from traceml_records._rules import (
    IDENTITY_RULES,
    LineCheck,
    duration_ok,
    export_shows_loss,
    identity_ok,
    line_checks,
    line_findings,
    parallel_ok,
    parallel_source_ok,
    topology_of,
)
from traceml_records._scan import REASONS, FileScan, FileState
from traceml_records._scan_py import LINE, Layout, RowsLayout
from traceml_records._wire_spec import FanOut, WireStream

__all__ = [
    "BATCH_STREAMS",
    "BLOCK_BYTES",
    "CHECKS",
    "CLOSING_KEY",
    "ENCODER_CONDITIONS",
    "ENCODER_PLANS",
    "FILE_STREAMS_OF_BATCH",
    "IDENTITY_RULES",
    "ITEM_LOADERS",
    "LINE",
    "LOADERS",
    "PURE_PYTHON_ENV",
    "REASONS",
    "STREAM_BY_CLASS",
    "WIRE_STREAMS",
    "CollectivesItem",
    "FanOut",
    "FieldPath",
    "FileScan",
    "FileState",
    "Flag",
    "Layout",
    "LineCheck",
    "LineKind",
    "LineSplitter",
    "ParallelCoordinateItem",
    "PhaseTimingItem",
    "ProcessItem",
    "RowsLayout",
    "RuntimeEnvironmentItem",
    "StdoutStderrItem",
    "StepMemoryItem",
    "StepTimeItem",
    "SystemGpuItem",
    "SystemItem",
    "WireStream",
    "classify_line",
    "closing_of",
    "dumps_line",
    "dumps_lines",
    "duration_ok",
    "encode_batch",
    "encode_items",
    "export_shows_loss",
    "identity_ok",
    "is_closing",
    "line_checks",
    "line_findings",
    "load_extension",
    "parallel_ok",
    "parallel_source_ok",
    "scan_lines",
    "split_batch",
    "topology_of",
]
