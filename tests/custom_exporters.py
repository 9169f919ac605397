"""Exporter factories and wire-batch makers shared by the export tests.

Factories are named by ``module:factory`` values, in process and through the real CLI
(``traceml run --exporter tests.custom_exporters:make_exporter``, with the repository
root on ``sys.path``). ``make_exporter`` writes what it receives under the run
folder, so a test can check it after the aggregator process is gone.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from traceml_ai.export import ExportContext, ExportSummary, InMemoryExporter
from traceml_ai.testing import (
    OBSERVED_TIMESTAMP_NS,
    make_batch,
    make_gpu_entry,
    make_identity,
    make_item,
    make_phase,
)
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import STREAMS_BY_NAME
from traceml_records._generated.records import DUMPERS
from traceml_records._registry import STREAM_BY_CLASS

CUSTOM_DIR = "custom_export"
"""Folder (under the run folder) where ``make_exporter`` writes."""
RECORDS_FILE = "records.jsonl"
"""One line per record received: its stream, class name and JSON object."""
CLOSE_FILE = "close.json"
"""The summary ``close`` received, and the context the factory got."""


class FileRecordingExporter:
    """Writes every record it gets (and the close summary) under ``<run_dir>/custom_export/``.

    It refuses (raises) records of a stream that is not selected or of the wrong class,
    so an end-to-end test also checks that only selected, typed records arrive.
    """

    def __init__(self, context: ExportContext) -> None:
        self.context = context
        self.dir = Path(context.run_dir) / CUSTOM_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.dir / RECORDS_FILE, "xb")  # noqa: SIM115 - closed in close()
        self._lock = threading.Lock()

    def export(self, records: Sequence[Any]) -> None:
        lines = []
        for record in records:
            spec = STREAM_BY_CLASS.get(type(record))
            if spec is None or spec.name not in self.context.streams:
                raise TypeError(f"unexpected record {type(record).__name__}")
            obj = DUMPERS[type(record)](record, self.context.include_hostname)
            lines.append(
                orjson.dumps({"stream": spec.name, "class": type(record).__name__, "record": obj})
                + b"\n"
            )
        with self._lock:
            self._file.write(b"".join(lines))
            self._file.flush()

    def close(self, summary: ExportSummary) -> None:
        with self._lock:
            self._file.close()
        (self.dir / CLOSE_FILE).write_bytes(
            orjson.dumps(
                {
                    "written_records": dict(summary.written_records),
                    "dropped_batches": summary.dropped_batches,
                    "streams": list(self.context.streams),
                    "include_hostname": self.context.include_hostname,
                    "export_dir": str(self.context.export_dir),
                }
            )
        )


def make_exporter(context: ExportContext) -> FileRecordingExporter:
    """The good custom factory: records go to ``<run_dir>/custom_export/records.jsonl``."""
    return FileRecordingExporter(context)


def make_memory_exporter(context: ExportContext) -> InMemoryExporter:
    """A custom factory returning the shipped in-memory exporter."""
    return InMemoryExporter(context)


NOT_CALLABLE = 42
"""``tests.custom_exporters:NOT_CALLABLE`` names something that is not a factory."""


def raising_factory(context: ExportContext) -> Any:
    """A factory that fails; its traceback should reach the user."""
    raise RuntimeError("factory exploded on purpose")


def factory_without_methods(context: ExportContext) -> Any:
    """Returns an object with neither ``export`` nor ``close``."""
    return object()


class _ExportOnly:
    def export(self, records: Sequence[Any]) -> None:
        pass

    close = "not a method"


def factory_without_close(context: ExportContext) -> Any:
    """Returns an object whose ``close`` is not callable."""
    return _ExportOnly()


class RaisingExporter(InMemoryExporter):
    """Raises in ``export`` on each stream's calls 0, ``fail_every``, 2 * ``fail_every``,
    ...; keeps the rest. Counted per stream, so every stream that is exported at all
    sees a failure, however the worker groups its records into calls."""

    def __init__(self, fail_every: int = 1) -> None:
        super().__init__()
        self.fail_every = fail_every
        self.calls = 0
        self.calls_by_stream: dict[str, int] = {}
        self.failed: dict[str, list[Any]] = {}

    def export(self, records: Sequence[Any]) -> None:
        stream = STREAM_BY_CLASS[type(records[0])].name
        index = self.calls_by_stream.get(stream, 0)
        self.calls_by_stream[stream] = index + 1
        self.calls += 1
        if index % self.fail_every == 0:
            self.failed.setdefault(stream, []).extend(records)
            raise OSError(f"{stream} export call {index} failed on purpose")
        super().export(records)


class HangingExporter(InMemoryExporter):
    """Blocks in ``export`` (after ``hang_after`` calls) or in ``close`` until ``release``."""

    def __init__(self, hang_in: str, hang_after: int = 0) -> None:
        super().__init__()
        self.hang_in = hang_in
        self.hang_after = hang_after
        self.release = threading.Event()
        self.entered = threading.Event()
        self._calls = 0

    def export(self, records: Sequence[Any]) -> None:
        self._calls += 1
        if self.hang_in == "export" and self._calls > self.hang_after:
            self.entered.set()
            self.release.wait()
        super().export(records)

    def close(self, summary: ExportSummary) -> None:
        if self.hang_in == "close":
            self.entered.set()
            self.release.wait()
        super().close(summary)


# -- wire batches ----------------------------------------------------------------------
# Built with traceml_ai.testing's factory, which the benches use too; the values here
# are the ones these tests were written against.

IDENTITY: dict[str, Any] = make_identity(1, world_size=4, local_world_size=2)
"""Rank 1 of 4, two per node: a valid identity for every stream except system."""

IDENTITY_LOCAL0: dict[str, Any] = {**IDENTITY, "global_rank": 0, "local_rank": 0}
"""Local rank 0: may send system snapshots."""

OBSERVED_NS = OBSERVED_TIMESTAMP_NS

phase = make_phase
"""One phase timing as a rank sends it (GPU time used when given)."""


def step_time_item(seq: int = 0, step: int = 1, device: str = "cpu") -> dict[str, Any]:
    gpu = 2.0 if device.startswith("cuda") else None
    events = {
        "_traceml_internal:forward_time": {device: phase(8.2, gpu)},
        "_traceml_internal:backward_time": {device: phase(15.3, gpu)},
        "_traceml_internal:step_time": {device: phase(27.0)},
        "my_phase": {device: phase(0.5, gpu, n_calls=3)},
    }
    return make_item("step_time", seq, step=step, events=events)


def step_memory_item(seq: int = 0, step: int = 1, device: str = "cpu") -> dict[str, Any]:
    return make_item("step_memory", seq, device=device, step=step)


def process_item(seq: int = 0, gpu: bool = False) -> dict[str, Any]:
    return make_item("process", seq, device="cuda:1" if gpu else "cpu")


def gpu_entry(index: int) -> dict[str, Any]:
    # An integer temperature: NVML reports whole degrees, and the builder takes them.
    return make_gpu_entry(index, temperature_c=61)


def system_item(seq: int = 0, gpus: int = 2) -> dict[str, Any]:
    return make_item(
        "system", seq, gpus=[gpu_entry(i) for i in range(gpus)], gpu_available=gpus > 0
    )


def runtime_item(seq: int = 0) -> dict[str, Any]:
    """For IDENTITY (4 ranks, 2 per node): a multi-node run with gloo up."""
    return make_item("runtime_environment", seq, identity=IDENTITY, distributed_backend="gloo")


def stdout_item(seq: int = 0, line: str = "epoch 1 done") -> dict[str, Any]:
    return make_item("stdout_stderr", seq, line=line)


def batch(
    stream: str,
    items: list[Any],
    identity: Any = None,
    observed: Any = OBSERVED_NS,
    nbytes: int | None = None,
) -> ReceivedBatch:
    """A received wire batch; ``nbytes`` defaults to the encoded payload's size."""
    ident = (IDENTITY_LOCAL0 if stream == "system" else IDENTITY) if identity is None else identity
    return make_batch(stream, items, ident, observed=observed, nbytes=nbytes)


ALL_FILE_STREAMS: tuple[str, ...] = tuple(STREAMS_BY_NAME)
