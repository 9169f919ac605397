"""The exporter protocol: what the export worker hands records to.

The built-in JSONL exporter, the in-memory exporter and users' custom exporters
(``exporter: my_pkg.my_module:make_exporter``) all implement it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs


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


@runtime_checkable
class Exporter(Protocol):
    """Receives typed records of the selected streams from the export worker thread."""

    def export(self, records: Sequence[Any]) -> None:
        """Write a non-empty sequence of records of ONE stream; raise if they were not written."""

    def close(self, summary: ExportSummary) -> None:
        """Finish (e.g. write closing lines); called once, after the drain."""


ExporterFactory = Callable[[ExportContext], Exporter]
"""``module:factory`` names one of these."""
