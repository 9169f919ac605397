"""The aggregator's export pipeline: pick the exporter, run the worker, report the loss.

``start_export`` is the one entry point the aggregator needs. Export never fails the
run: when the exporter cannot start (a JSONL file already exists, a custom factory is
broken), the pipeline still builds the selected records and counts them as failed,
with ``exporter_failed`` true, so the loss shows in ``finalization_warning.json``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from traceml_ai.export._builder import RecordBuilder
from traceml_ai.export._custom import ExporterStartFailure, create_exporter, report_to_stderr
from traceml_ai.export._jsonl import JsonlExporter
from traceml_ai.export._protocol import (
    ExportContext,
    Exporter,
    ExportResult,
    ExportSummary,
    export_input_of,
)
from traceml_ai.export._worker import (
    DEFAULT_MAX_QUEUE_BATCHES,
    DEFAULT_MAX_QUEUE_BYTES,
    ExportStats,
    ExportWorker,
)
from traceml_ai.settings import ExportSettings, exporter_kind
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import ExportLoss

__all__ = ["EXPORT_DIR_PARTS", "ExportPipeline", "builder_for", "start_export"]

_log = logging.getLogger("traceml_ai.export")

EXPORT_DIR_PARTS = ("aggregator", "export")
"""The export folder, relative to the run folder."""

# How long JsonlExporter.close waits for a write in progress. In a normal shutdown the
# worker itself closes (no write in progress); this only matters when the worker is
# stuck in a write and close runs on a helper thread for a short bounded time.
_JSONL_CLOSE_WAIT_S = 0.1


class _UnavailableExporter:
    """Stands in for an exporter that could not start: every record counts as failed."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def export(self, records: Sequence[Any]) -> ExportResult:
        return ExportResult(written=0, failed=len(records), problem=self.reason)

    def close(self, summary: ExportSummary) -> None:
        return None


class ExportPipeline:
    """The running export of one aggregator: a worker fed by ``submit``.

    ``failure`` holds the start-failure message when the exporter could not start;
    the pipeline then still counts the selected records (as failed).
    """

    def __init__(
        self, worker: ExportWorker, context: ExportContext, *, failure: str | None = None
    ) -> None:
        self._worker = worker
        self.context = context
        self.failure = failure
        self._final: ExportStats | None = None

    @property
    def worker(self) -> ExportWorker:
        """The export worker (for live counters)."""
        return self._worker

    def submit(self, batch: ReceivedBatch) -> None:
        """Queue a received batch; never blocks, never raises (a full queue drops it)."""
        self._worker.submit(batch)

    def submit_many(self, batches: list[ReceivedBatch]) -> None:
        """Queue received batches in order (one lock round); as :meth:`submit` each."""
        self._worker.submit_many(batches)

    def set_rank_dropped_batches(self, batches: int) -> None:
        """Batches the ranks reported dropping; they join ``dropped_batches`` (see
        :meth:`ExportWorker.set_rank_dropped_batches`). Call it before :meth:`finalize`."""
        self._worker.set_rank_dropped_batches(batches)

    def stats(self) -> ExportStats:
        """Live counters, or the final ones after :meth:`finalize`."""
        return self._final if self._final is not None else self._worker.stats()

    def finalize(self, timeout: float) -> ExportStats:
        """Drain for at most ``timeout`` s, close the exporter, return the final counts.

        Idempotent. Returns within about ``timeout + 0.75`` s even if the exporter hangs.
        """
        if self._final is None:
            self._final = self._worker.shutdown(timeout)
        return self._final

    def loss(self) -> ExportLoss | None:
        """The ``export`` block for ``finalization_warning.json``; None when nothing was lost.

        Before :meth:`finalize` it reflects the live counters.
        """
        return self.stats().to_loss()


def builder_for(exporter: object, streams: Iterable[str], include_hostname: bool) -> RecordBuilder:
    """The record builder for ``exporter``: its mode follows what the exporter declares.

    An exporter that takes encoded lines (``export_input = "encoded_lines"``, as the JSONL
    exporter does) gets groups the builder writes straight from the wire items, with no
    typed records in between; any other gets typed records.
    """
    return RecordBuilder(
        streams, include_hostname, encode_lines=export_input_of(exporter) == "encoded_lines"
    )


def _open_exporter(
    settings: ExportSettings,
    context: ExportContext,
    report: Callable[[str], None] | None,
) -> tuple[Exporter | None, str | None]:
    """The exporter, or (None, message) when it could not start."""
    if exporter_kind(settings.exporter) == "jsonl":
        try:
            return JsonlExporter.create(context, close_wait_s=_JSONL_CLOSE_WAIT_S), None
        except Exception as exc:
            # ExportTargetExists, ExportStartError, OSError: export is off for this run.
            message = f"exporter 'jsonl': {exc}"
            if report is not None:
                report(message)
            return None, message
    made = create_exporter(settings.exporter, context, report=report)
    if isinstance(made, ExporterStartFailure):
        return None, made.message
    return made, None


def start_export(
    settings: ExportSettings,
    run_dir: Path,
    *,
    selected_streams: tuple[str, ...] | None = None,
    max_queue_batches: int = DEFAULT_MAX_QUEUE_BATCHES,
    max_queue_bytes: int = DEFAULT_MAX_QUEUE_BYTES,
    report: Callable[[str], None] | None = report_to_stderr,
) -> ExportPipeline | None:
    """Start the export of one run; None when the exporter setting is off.

    ``selected_streams`` (file stream names) defaults to what
    ``settings.export_streams`` selects. The exporter is ``JsonlExporter`` for ``jsonl``, else
    the custom ``module:factory``; the builder's mode follows what the exporter declares
    (``export_input``: typed records unless it takes encoded lines). If it cannot start, ``report`` gets one message
    (default: printed to stderr) and the returned pipeline counts every selected
    record as failed, with ``exporter_failed`` true. The worker thread is started.
    """
    if exporter_kind(settings.exporter) == "off":
        return None
    streams = (
        settings.export_streams.selected if selected_streams is None else tuple(selected_streams)
    )
    builder = RecordBuilder(streams, settings.exporter_hostname)
    run_dir = Path(run_dir)
    context = ExportContext(
        run_dir=run_dir,
        export_dir=run_dir.joinpath(*EXPORT_DIR_PARTS),
        streams=builder.streams,
        include_hostname=settings.exporter_hostname,
    )
    exporter, failure = _open_exporter(settings, context, report)
    if exporter is None:
        exporter = _UnavailableExporter(failure or "the exporter could not start")
    builder = builder_for(exporter, builder.streams, settings.exporter_hostname)
    worker = ExportWorker(
        exporter,
        builder,
        max_queue_batches=max_queue_batches,
        max_queue_bytes=max_queue_bytes,
        exporter_failed=failure is not None,
    )
    worker.start()
    return ExportPipeline(worker, context, failure=failure)
