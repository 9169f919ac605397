"""The exporter protocol: what the export worker hands records to.

The built-in JSONL exporter, the in-memory exporter and users' custom exporters
(``exporter: my_pkg.my_module:make_exporter``) all implement it.

An exporter declares what it takes in its ``export_input`` attribute:
``"records"`` (typed records; the default when the attribute is absent, so every
custom exporter written against the plain protocol gets them) or
``"encoded_lines"`` (groups may come as :class:`EncodedLines`, the lines already
written by the builder: the built-in JSONL exporter's fast path). The pipeline
reads the declaration with :func:`export_input_of` and never looks at the
exporter's class.

``export`` reports what it wrote as a value: ``None`` means every record was
written (a custom exporter raises when they were not, and the whole group counts
as failed); an exporter that can tell exactly which part of a group it wrote
returns an :class:`ExportResult` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

import attrs

ExportInput = Literal["records", "encoded_lines"]
"""What an exporter takes: typed records, or groups that may be encoded lines."""

EXPORT_INPUT_DEFAULT: ExportInput = "records"
"""What an exporter without an ``export_input`` attribute takes."""


@attrs.frozen(kw_only=True)
class ExportContext:
    """What an exporter factory is told about the run it exports."""

    run_dir: Path
    """``<logs-dir>/<run-name>/``."""
    export_dir: Path
    """``<run_dir>/aggregator/export/``; the JSONL exporter creates it."""
    streams: tuple[str, ...]
    """Selected file streams (``traceml_records`` stream names), in registry order."""
    include_hostname: bool
    """Whether lines carry ``hostname`` (the exporter hostname setting)."""


@attrs.frozen(kw_only=True)
class ExportSummary:
    """Final counts handed to ``Exporter.close`` once, after the drain."""

    written_records: Mapping[str, int]
    """Records of each selected stream that ``export`` accepted (did not raise for)."""
    dropped_batches: int
    """Payload batches the worker dropped (full queue, after shutdown, left at the deadline)."""


@attrs.frozen(kw_only=True)
class ExportResult:
    """What one ``export`` call did with its group: every record is counted once.

    ``written + failed + abandoned`` is the group's length.
    """

    written: int
    """Records written whole."""
    failed: int = 0
    """Records not written for a reason of their own (e.g. no valid line), or because the
    exporter could not take them (not a selected stream, closed)."""
    abandoned: int = 0
    """Records not written because their destination failed for good (e.g. a file whose
    write failed); later groups of the stream are abandoned too."""
    problem: str | None = None
    """Why some records were not written (one line, for the log); None when all were."""

    @property
    def total(self) -> int:
        """The group's length as this result accounts for it."""
        return self.written + self.failed + self.abandoned

    @property
    def not_written(self) -> int:
        """Records of the group that count as failed (``failed + abandoned``)."""
        return self.failed + self.abandoned


class ExporterError(Exception):
    """An expected failure of an exporter (disk full, a file removed) that explains itself.

    The worker logs its message as one line; any other exception from an exporter is
    taken for a bug in it and logged with its traceback.
    """


@runtime_checkable
class Exporter(Protocol):
    """Receives records of the selected streams from the export worker thread.

    A custom exporter implements ``export`` returning None (raising when the records
    were not written: the whole group then counts as failed) and ``close``. It takes
    typed records unless it declares ``export_input = "encoded_lines"`` (see
    :func:`export_input_of`).
    """

    def export(self, records: Sequence[Any]) -> ExportResult | None:
        """Write a non-empty sequence of records of ONE stream.

        Return None when every record was written, raise when they were not, or return an
        :class:`ExportResult` that says exactly how many were written.
        """

    def close(self, summary: ExportSummary) -> None:
        """Finish (e.g. write closing lines); called once, after the drain."""


@runtime_checkable
class LineExporter(Exporter, Protocol):
    """An exporter that takes encoded lines: its groups may be :class:`EncodedLines`.

    Such a group is still a sequence of records (indexing it parses a line back), but
    its ``data`` holds the group's lines, already written by the builder with the same
    bytes ``traceml_records.dumps_line`` gives.
    """

    export_input: Literal["encoded_lines"]


def export_input_of(exporter: object) -> ExportInput:
    """What ``exporter`` declares it takes (``export_input``); typed records by default.

    Only the exact value ``"encoded_lines"`` asks for lines: a missing, misspelt or
    non-string declaration gets typed records, which every exporter can take.
    """
    try:
        declared = getattr(exporter, "export_input", EXPORT_INPUT_DEFAULT)
    except Exception:
        # A custom exporter's property that raises must not stop the export from starting.
        return EXPORT_INPUT_DEFAULT
    return "encoded_lines" if type(declared) is str and declared == "encoded_lines" else "records"


ExporterFactory = Callable[[ExportContext], Exporter]
"""``module:factory`` names one of these."""
