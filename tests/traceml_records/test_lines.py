"""traceml_records._lines: the one line scanner every reader of the files uses."""

from __future__ import annotations

import io

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
