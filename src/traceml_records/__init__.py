"""The TraceML export contract in Python: typed records, the stream registry, codecs and validation.

Light to import: attrs, orjson and jsonschema only, never torch.
"""

from traceml_records._codec import (
    AnyRecord,
    StreamRecord,
    dumps_line,
    dumps_warning_file,
    loads_line,
    loads_warning_file,
)
from traceml_records._errors import RecordError
from traceml_records._generated.records import (
    ClosingLine,
    ExportLoss,
    FinalizationWarning,
    MonitoringLoss,
    ParallelCoordinate,
    PhaseTiming,
    ProcessRecord,
    RuntimeEnvironmentRecord,
    StdoutStderrRecord,
    StepMemoryRecord,
    StepTimeRecord,
    SystemGpuRecord,
    SystemRecord,
)
from traceml_records._generated.registry import SELECTION_NAMES, STREAMS
from traceml_records._linecheck import Problem, validate_line
from traceml_records._reader import LineError, read_jsonl
from traceml_records._registry import (
    DEFAULT_EXPORT_STREAMS,
    STREAMS_BY_NAME,
    parse_export_streams,
    stream_spec,
    streams_selected_by,
)
from traceml_records._stream_spec import StreamSpec
from traceml_records._validate import FileSummary, ValidationReport, validate_paths

SCHEMA_VERSION = 1
"""``schema_version`` of every line this release writes."""

__all__ = [
    "DEFAULT_EXPORT_STREAMS",
    "SCHEMA_VERSION",
    "SELECTION_NAMES",
    "STREAMS",
    "STREAMS_BY_NAME",
    "AnyRecord",
    "ClosingLine",
    "ExportLoss",
    "FileSummary",
    "FinalizationWarning",
    "LineError",
    "MonitoringLoss",
    "ParallelCoordinate",
    "PhaseTiming",
    "Problem",
    "ProcessRecord",
    "RecordError",
    "RuntimeEnvironmentRecord",
    "StdoutStderrRecord",
    "StepMemoryRecord",
    "StepTimeRecord",
    "StreamRecord",
    "StreamSpec",
    "SystemGpuRecord",
    "SystemRecord",
    "ValidationReport",
    "dumps_line",
    "dumps_warning_file",
    "loads_line",
    "loads_warning_file",
    "parse_export_streams",
    "read_jsonl",
    "stream_spec",
    "streams_selected_by",
    "validate_line",
    "validate_paths",
]
