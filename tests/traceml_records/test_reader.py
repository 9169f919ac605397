"""read_jsonl: typed records of one export file, finished or still being written."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import attrs
import pytest

from tests.records_helpers import EXAMPLE_CLOSING_LINE, EXAMPLE_DATA_LINE
from traceml_records import (
    ClosingLine,
    LineError,
    RecordError,
    StepTimeRecord,
    dumps_line,
    loads_line,
    read_jsonl,
)


def data_line(seq: int) -> bytes:
    record = loads_line(EXAMPLE_DATA_LINE)
    assert type(record) is StepTimeRecord
    return dumps_line(attrs.evolve(record, seq=seq, step=seq + 1))


def closing_line(count: int) -> bytes:
    return dumps_line(ClosingLine(stream="step_time", written_records=count, dropped_batches=0))


def test_reads_a_finished_file_with_its_closing_line(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(EXAMPLE_DATA_LINE + EXAMPLE_CLOSING_LINE)
    records = list(read_jsonl(path))
    assert [type(r) for r in records] == [StepTimeRecord, ClosingLine]
    assert records[0] == loads_line(EXAMPLE_DATA_LINE)
    assert records[1] == ClosingLine(stream="step_time", written_records=8, dropped_batches=0)
    assert list(read_jsonl(str(path))) == records  # str paths too


def test_an_unterminated_last_line_is_not_yielded(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(data_line(0) + data_line(1) + data_line(2)[:-30])
    records = list(read_jsonl(path))
    assert [r.seq for r in records] == [0, 1]  # type: ignore[union-attr]
    path.write_bytes(data_line(0) + data_line(1)[:-1])  # only the newline missing
    assert len(list(read_jsonl(path))) == 1


def test_an_empty_file_yields_nothing(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(b"")
    assert list(read_jsonl(path)) == []


def test_a_bad_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    bad = EXAMPLE_DATA_LINE.replace(b'"rank":1,', b'"rank":"1",')
    path.write_bytes(data_line(0) + bad + closing_line(2))
    reader = read_jsonl(path)
    assert type(next(reader)) is StepTimeRecord
    with pytest.raises(LineError) as info:
        next(reader)
    error = info.value
    assert isinstance(error, RecordError)
    assert (error.file, error.line, error.pointer) == (str(path), 2, "/rank")
    assert str(error).startswith(f"{path}:2: /rank: expected integer")


def test_blank_line_and_invalid_json_are_errors(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(data_line(0) + b"\n" + closing_line(1))
    with pytest.raises(LineError, match=r":2: /: invalid JSON"):
        list(read_jsonl(path))


def test_a_line_after_the_closing_line_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(closing_line(0) + data_line(0))
    reader = read_jsonl(path)
    assert type(next(reader)) is ClosingLine
    with pytest.raises(LineError, match=r":2: /: line after the closing line"):
        next(reader)


def test_missing_file_without_follow_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        list(read_jsonl(tmp_path / "nope.jsonl"))


def _writer(path: Path, chunks: list[bytes], pause: float) -> threading.Thread:
    def run() -> None:
        with open(path, "ab") as f:
            for chunk in chunks:
                time.sleep(pause)
                f.write(chunk)
                f.flush()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_follow_reads_lines_as_another_thread_appends_them(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(data_line(0))
    lines = [data_line(i) for i in range(1, 6)]
    # Split lines across writes so the reader sees partial lines in between.
    chunks = [lines[0][:20], lines[0][20:] + lines[1], lines[2][:-1], lines[2][-1:] + lines[3]]
    chunks += [lines[4], closing_line(6)]
    thread = _writer(path, chunks, pause=0.02)
    records = list(read_jsonl(path, follow=True, poll_interval=0.005, timeout=10))
    thread.join(5)
    assert [r.seq for r in records[:-1]] == list(range(6))  # type: ignore[union-attr]
    assert records[-1] == ClosingLine(stream="step_time", written_records=6, dropped_batches=0)


def test_follow_waits_for_the_file_to_appear(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"

    def create() -> None:
        time.sleep(0.05)
        path.write_bytes(data_line(0) + closing_line(1))

    threading.Thread(target=create, daemon=True).start()
    records = list(read_jsonl(path, follow=True, poll_interval=0.01, timeout=10))
    assert [type(r) for r in records] == [StepTimeRecord, ClosingLine]


def test_follow_times_out_without_a_closing_line(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(data_line(0) + data_line(1)[:10])
    seen = []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no closing line"):
        for record in read_jsonl(path, follow=True, poll_interval=0.01, timeout=0.2):
            seen.append(record)
    assert 0.15 < time.monotonic() - started < 5
    assert len(seen) == 1
    with pytest.raises(TimeoutError, match="did not appear"):
        list(read_jsonl(tmp_path / "never.jsonl", follow=True, poll_interval=0.01, timeout=0.05))


def test_follow_stops_at_the_closing_line(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    path.write_bytes(data_line(0) + closing_line(1))
    started = time.monotonic()
    records = list(read_jsonl(path, follow=True, poll_interval=5, timeout=60))
    assert time.monotonic() - started < 2  # no poll after the closing line
    assert type(records[-1]) is ClosingLine


def test_strict_by_default_and_lenient_on_request(tmp_path: Path) -> None:
    """A line that breaks a named rule (not the schema): refused like validate does,
    read with strict=False."""
    path = tmp_path / "step_time.jsonl"
    record = loads_line(EXAMPLE_DATA_LINE)
    assert type(record) is StepTimeRecord
    beyond = EXAMPLE_DATA_LINE.replace(b'"world_size":2,', b'"world_size":1,', 1)
    assert beyond != EXAMPLE_DATA_LINE
    path.write_bytes(data_line(0) + beyond + closing_line(2))
    with pytest.raises(LineError) as info:
        list(read_jsonl(path))
    assert (info.value.line, info.value.pointer) == (2, "/global_rank")
    records = list(read_jsonl(path, strict=False))
    assert [type(r) for r in records] == [StepTimeRecord, StepTimeRecord, ClosingLine]
