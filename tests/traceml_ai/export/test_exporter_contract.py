"""The exporter contract, one suite over every kind of exporter.

Each implementation runs the same tests: the built-in JSONL exporter (takes encoded
lines, returns :class:`ExportResult` values), the shipped in-memory exporter (typed
records), a plain custom exporter written against the documented contract
(``export(records)`` returning None, raising when the records were not written) and
a custom exporter that declares ``export_input = "encoded_lines"``. The records each
one ends up holding must be the ones the builder's record mode builds (the oracle),
and the worker's counts must say exactly what was written and what failed.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.custom_exporters import (
    batch,
    process_item,
    step_memory_item,
    step_time_item,
)
from traceml_ai.export import (
    EncodedLines,
    ExportContext,
    ExportResult,
    ExportSummary,
    ExportWorker,
    InMemoryExporter,
    JsonlExporter,
    RecordBuilder,
    builder_for,
    export_input_of,
    start_export,
)
from traceml_ai.export._builder import _LINE_PLANS
from traceml_ai.settings import ExportSettings
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import STREAMS_BY_NAME, loads_line
from traceml_records._codec import encode_items
from traceml_records._registry import STREAM_BY_CLASS

STREAMS = ("step_time", "step_memory", "process")


class PlainCustomExporter:
    """A custom exporter exactly as docs/live-export.md shows one: no declaration,
    ``export`` returns None, and raises once ``broken`` is set."""

    def __init__(self) -> None:
        self.records: dict[str, list[Any]] = {}
        self.groups: list[type] = []
        self.broken = False
        self.closed_with: ExportSummary | None = None

    def export(self, records: Sequence[Any]) -> None:
        self.groups.append(type(records))
        if self.broken:
            raise OSError(errno.EIO, "the custom sink is gone")
        stream = STREAM_BY_CLASS[type(records[0])].name
        self.records.setdefault(stream, []).extend(records)

    def close(self, summary: ExportSummary) -> None:
        self.closed_with = summary


class LineTakingCustomExporter(PlainCustomExporter):
    """A custom exporter that declares it takes encoded lines, and keeps the raw lines."""

    export_input = "encoded_lines"

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[bytes] = []

    def export(self, records: Sequence[Any]) -> None:
        self.groups.append(type(records))
        if self.broken:
            raise OSError(errno.EIO, "the custom sink is gone")
        if isinstance(records, EncodedLines):
            self.lines.extend(records.data.splitlines(keepends=True))
            typed = list(records)  # still a sequence of records: indexing parses a line
        else:
            typed = list(records)
        stream = STREAM_BY_CLASS[type(typed[0])].name
        self.records.setdefault(stream, []).extend(typed)


@attrs.frozen
class Impl:
    """One exporter implementation and how the suite drives it."""

    name: str
    make: Callable[[ExportContext], Any]
    read: Callable[[Any, ExportContext], dict[str, list[Any]]]
    """The typed records the exporter holds, per stream."""
    break_: Callable[[Any], None]
    """Make every later ``export`` of the exporter fail."""
    takes: str
    """What it declares it takes."""
    close_fails_after_break: bool
    """Whether ``close`` reports the failure again (a file without its closing line)."""


def _read_jsonl(exporter: JsonlExporter, ctx: ExportContext) -> dict[str, list[Any]]:
    got: dict[str, list[Any]] = {}
    for stream in ctx.streams:
        path = ctx.export_dir / STREAMS_BY_NAME[stream].file_name
        lines = [line for line in path.read_bytes().splitlines() if b'"closing":true' not in line]
        got[stream] = [loads_line(line) for line in lines]
    return got


def _break_jsonl(exporter: JsonlExporter) -> None:
    # A real ENOSPC from the kernel on every later write: /dev/full behind each descriptor.
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        for f in exporter._files.values():
            assert f.fd is not None
            os.dup2(full, f.fd)
    finally:
        os.close(full)


def _break_memory(exporter: InMemoryExporter) -> None:
    def refuse(records: Sequence[Any]) -> None:
        raise OSError(errno.EIO, "the in-memory sink refuses on purpose")

    exporter.export = refuse  # type: ignore[method-assign]


def _break_custom(exporter: PlainCustomExporter) -> None:
    exporter.broken = True


IMPLS = [
    Impl(
        name="jsonl",
        make=JsonlExporter.create,
        read=_read_jsonl,
        break_=_break_jsonl,
        takes="encoded_lines",
        close_fails_after_break=True,
    ),
    Impl(
        name="in_memory",
        make=InMemoryExporter,
        read=lambda exporter, ctx: exporter.records,
        break_=_break_memory,
        takes="records",
        close_fails_after_break=False,
    ),
    Impl(
        name="custom",
        make=lambda ctx: PlainCustomExporter(),
        read=lambda exporter, ctx: exporter.records,
        break_=_break_custom,
        takes="records",
        close_fails_after_break=False,
    ),
    Impl(
        name="custom_lines",
        make=lambda ctx: LineTakingCustomExporter(),
        read=lambda exporter, ctx: exporter.records,
        break_=_break_custom,
        takes="encoded_lines",
        close_fails_after_break=False,
    ),
]


@pytest.fixture(params=IMPLS, ids=lambda impl: impl.name)
def impl(request: pytest.FixtureRequest) -> Impl:
    return request.param  # type: ignore[no-any-return]


def _context(tmp_path: Path) -> ExportContext:
    run_dir = tmp_path / "run"
    return ExportContext(
        run_dir=run_dir,
        export_dir=run_dir / "aggregator" / "export",
        streams=STREAMS,
        include_hostname=False,
    )


def _batches(first_seq: int, groups: int) -> list[ReceivedBatch]:
    """``groups`` rounds of one batch per stream; each step_time batch has one bad item."""
    out = []
    for g in range(groups):
        seq = first_seq + g * 10
        items: list[Any] = [step_time_item(seq=seq + i, step=seq + i + 1) for i in range(5)]
        items.insert(2, {"malformed": True})
        out.append(batch("step_time", items))
        out.append(batch("step_memory", [step_memory_item(seq=seq + i) for i in range(3)]))
        out.append(batch("process", [process_item(seq=seq + i) for i in range(2)]))
    return out


def _oracle(batches: list[ReceivedBatch]) -> dict[str, list[Any]]:
    """The records the builder's record mode builds from ``batches``."""
    builder = RecordBuilder(STREAMS, include_hostname=False)
    got: dict[str, list[Any]] = {}
    for received in batches:
        for stream, records in builder.build(received).records.items():
            got.setdefault(stream, []).extend(records)
    return got


def _worker(impl: Impl, ctx: ExportContext) -> tuple[Any, ExportWorker]:
    exporter = impl.make(ctx)
    worker = ExportWorker(exporter, builder_for(exporter, STREAMS, ctx.include_hostname))
    return exporter, worker


def test_declares_what_it_takes_and_the_builder_follows(impl: Impl, tmp_path: Path) -> None:
    exporter, worker = _worker(impl, _context(tmp_path))
    assert export_input_of(exporter) == impl.takes
    assert worker.export_input == impl.takes
    # Line mode needs the C encoder; without it every exporter gets typed records.
    assert worker.encodes_lines == (impl.takes == "encoded_lines" and encode_items is not None)
    worker.shutdown(timeout=5.0)


def test_every_record_arrives_as_the_builder_built_it(impl: Impl, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    exporter, worker = _worker(impl, ctx)
    worker.start()
    for received in _batches(0, groups=4):
        worker.submit(received)
    stats = worker.shutdown(timeout=10.0)

    # Built again from fresh batches: the worker's may have been consumed.
    expected = _oracle(_batches(0, groups=4))
    assert impl.read(exporter, ctx) == expected
    assert stats.written_records == {s: len(expected[s]) for s in STREAMS}
    assert stats.failed_total == 0 and stats.dropped_batches == 0
    assert stats.skipped_items == 4
    assert not stats.exporter_failed
    if isinstance(exporter, LineTakingCustomExporter) and worker.encodes_lines:
        # It got the lines themselves for the streams the C encoder writes, and they
        # parse to the same records.
        assert EncodedLines in exporter.groups
        parsed = [loads_line(line) for line in exporter.lines]
        encoded = [record for s in STREAMS if s in _LINE_PLANS for record in expected.get(s, [])]
        assert sorted(parsed, key=repr) == sorted(encoded, key=repr)


def test_a_broken_exporter_counts_its_records_as_failed(impl: Impl, tmp_path: Path) -> None:
    ctx = _context(tmp_path)
    exporter, worker = _worker(impl, ctx)
    worker.start()
    for received in _batches(0, groups=2):
        worker.submit(received)
    # Let the worker finish the first batches before the exporter breaks.
    _wait(lambda: worker.stats().written_total == 2 * (5 + 3 + 2))
    impl.break_(exporter)
    for received in _batches(100, groups=3):
        worker.submit(received)
    stats = worker.shutdown(timeout=10.0)

    expected = _oracle(_batches(0, groups=2))
    assert impl.read(exporter, ctx) == expected
    assert stats.written_records == {"step_time": 10, "step_memory": 6, "process": 4}
    assert stats.failed_records == {"step_time": 15, "step_memory": 9, "process": 6}
    assert stats.skipped_items == 5
    assert stats.dropped_batches == 0
    # A JSONL file that failed has no closing line, and close says so.
    assert stats.exporter_failed == impl.close_fails_after_break
    loss = stats.to_loss()
    assert loss is not None and loss.failed_records == 30 and loss.written_records == 20


def test_the_pipeline_picks_the_mode_from_the_declaration(tmp_path: Path) -> None:
    """start_export: the built-in JSONL exporter gets lines, the in-memory one records."""
    for exporter, takes in (
        ("jsonl", "encoded_lines"),
        ("traceml_ai.export:make_in_memory_exporter", "records"),
    ):
        run_dir = tmp_path / takes
        pipeline = start_export(ExportSettings(exporter=exporter), run_dir)
        assert pipeline is not None and pipeline.failure is None
        assert pipeline.worker.export_input == takes
        pipeline.finalize(timeout=5.0)


def test_an_exporter_that_cannot_start_counts_every_record_as_failed(tmp_path: Path) -> None:
    messages: list[str] = []
    settings = ExportSettings(exporter="tests.custom_exporters:raising_factory")
    pipeline = start_export(settings, tmp_path, report=messages.append)
    assert pipeline is not None and pipeline.failure is not None
    assert pipeline.worker.export_input == "records"
    pipeline.submit(batch("step_time", [step_time_item(seq=0), step_time_item(seq=1)]))
    stats = pipeline.finalize(timeout=5.0)
    assert stats.failed_records == {"step_time": 2} and stats.exporter_failed
    assert len(messages) == 1


# -- results as values ---------------------------------------------------------------


class _Answering:
    """An exporter that returns a given answer from every ``export`` call."""

    def __init__(self, answer: Callable[[int], Any]) -> None:
        self.answer = answer

    def export(self, records: Sequence[Any]) -> Any:
        return self.answer(len(records))

    def close(self, summary: ExportSummary) -> None:
        pass


@pytest.mark.parametrize(
    ("answer", "written"),
    [
        pytest.param(lambda n: None, 5, id="none-all-written"),
        pytest.param(lambda n: True, 5, id="any-other-value-all-written"),
        pytest.param(lambda n: ExportResult(written=n), 5, id="result-all"),
        pytest.param(lambda n: ExportResult(written=2, failed=1, abandoned=n - 3), 2, id="part"),
        pytest.param(lambda n: ExportResult(written=0, abandoned=n), 0, id="abandoned"),
        pytest.param(lambda n: ExportResult(written=n + 1), 0, id="overcount-distrusted"),
        pytest.param(lambda n: ExportResult(written=n, failed=-1, abandoned=1), 0, id="negative"),
    ],
)
def test_export_results_are_counted_as_values(answer: Callable[[int], Any], written: int) -> None:
    worker = ExportWorker(_Answering(answer), RecordBuilder(("step_time",), False))
    worker.start()
    worker.submit(batch("step_time", [step_time_item(seq=i) for i in range(5)]))
    stats = worker.shutdown(timeout=5.0)
    assert stats.written_records == {"step_time": written}
    assert stats.failed_records == {"step_time": 5 - written}
    assert not stats.exporter_failed


def test_a_line_builder_refuses_an_exporter_that_takes_records() -> None:
    builder = RecordBuilder(("step_time",), False, encode_lines=True)
    if not builder.encodes_lines:
        pytest.skip("no C encoder: the builder makes typed records anyway")
    with pytest.raises(ValueError, match="takes typed records"):
        ExportWorker(InMemoryExporter(), builder)


@pytest.mark.parametrize("declared", ["records", "Encoded_Lines", None, 1])
def test_anything_but_encoded_lines_declares_records(declared: object) -> None:
    class Declaring(PlainCustomExporter):
        export_input = declared

    assert export_input_of(Declaring()) == "records"


def test_a_declaration_that_raises_means_records() -> None:
    class Raising(PlainCustomExporter):
        @property
        def export_input(self) -> str:
            raise RuntimeError("boom")

    assert export_input_of(Raising()) == "records"


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.005)
