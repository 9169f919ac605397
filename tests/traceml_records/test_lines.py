"""traceml_records._lines: the one line scanner every reader of the files uses."""

from __future__ import annotations

import io
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from traceml_records.internal import LineKind, LineSplitter, classify_line, scan_lines


def test_kinds_of_lines() -> None:
    assert classify_line(b'{"stream":"step_time"}') == (LineKind.DATA, {"stream": "step_time"})
    kind, obj = classify_line(b'{"stream":"step_time","closing":true}')
    assert kind is LineKind.CLOSING and obj is not None
    # "closing" must be the JSON true, not a string or 1.
    assert classify_line(b'{"closing":"true"}')[0] is LineKind.DATA
    for bad in (b"", b"[1]", b'{"x":NaN}', b'{"x":Infinity}', b"{broken", b"\xff\xfe"):
        assert classify_line(bad) == (LineKind.BAD, None), bad


@given(
    lines=st.lists(st.binary(max_size=20).filter(lambda b: b"\n" not in b), max_size=20),
    tail=st.binary(max_size=10).filter(lambda b: b"\n" not in b),
    cuts=st.lists(st.integers(min_value=0, max_value=400), max_size=8),
)
def test_blocks_cut_anywhere_give_the_same_lines(
    lines: list[bytes], tail: bytes, cuts: list[int]
) -> None:
    data = b"".join(line + b"\n" for line in lines) + tail
    splitter = LineSplitter()
    got: list[bytes] = []
    start = 0
    for cut in [*sorted({min(c, len(data)) for c in cuts}), len(data)]:
        got += splitter.feed(data[start:cut])
        start = cut
    assert got == lines
    assert splitter.number == len(lines)
    # What follows the last newline is a line being written: held back, never a line.
    assert splitter.partial_last_line == bool(tail)
    assert splitter.pending == tail


def test_scan_numbers_lines_from_one_and_keeps_the_partial_line() -> None:
    splitter = LineSplitter()
    fh = io.BytesIO(b'{"a":1}\n{"closing":true}\n{"b":')
    assert list(scan_lines(fh, splitter)) == [(1, b'{"a":1}'), (2, b'{"closing":true}')]
    assert splitter.partial_last_line


def test_every_reader_sees_the_same_closing_lines(tmp_path: Any) -> None:
    """One rule (an object whose "closing" is true) for the scanner, validate, the
    run summary and the launcher's line count: a data line that holds the word as a
    value, or "closing": 1, is no closing line to any of them."""
    import orjson

    from traceml_ai.analysis import summarize_run
    from traceml_ai.launch._report import export_tally
    from traceml_records import validate_paths
    from traceml_records.internal import closing_of, is_closing

    data = {
        "stream": "stdout_stderr", "schema_version": 1, "observed_timestamp_unix_ns": 1,
        "rank": 0, "global_rank": 0, "local_rank": 0, "world_size": 1, "local_world_size": 1,
        "node_rank": 0, "timestamp_unix_ns": 1, "seq": 0, "stream_name": "stdout",
        "text": "closing", "pid": 1,
    }  # fmt: skip
    lines = [
        orjson.dumps(data),  # the word as a value: the key bytes are there, no closing
        orjson.dumps({**data, "seq": 1, "closing": 1}),  # not true: a (bad) data line
        orjson.dumps(
            {
                "stream": "stdout_stderr",
                "closing": True,
                "schema_version": 1,
                "written_records": 2,
                "dropped_batches": 0,
            }
        ),
    ]
    assert [closing_of(raw) is not None for raw in lines] == [False, False, True]
    assert [is_closing(orjson.loads(raw)) for raw in lines] == [False, False, True]
    export = tmp_path / "run" / "aggregator" / "export"
    export.mkdir(parents=True)
    (export / "stdout_stderr.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert export_tally(export) == (2, True)
    state = summarize_run(tmp_path / "run").loss.files["stdout_stderr"]
    assert (state.closing_lines, state.data_lines, state.written_records) == (1, 2, 2)
    (summary,) = validate_paths([export / "stdout_stderr.jsonl"]).files
    assert summary.closed and summary.data_lines == 2
