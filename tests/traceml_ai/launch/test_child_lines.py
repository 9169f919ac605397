"""ChildLines: a child's stdout read a line at a time, within a deadline."""

from __future__ import annotations

import os
import time

from traceml_ai.launch._child_lines import ChildLines


def test_lines_come_whole_and_what_follows_waits() -> None:
    r, w = os.pipe()
    try:
        os.write(w, b'{"event":"ready"}\n{"event":"fin')
        lines = ChildLines()
        assert lines.next_line(r, 1.0) == b'{"event":"ready"}'
        assert lines.next_line(r, 0.05) is None  # a partial line is not a line
        os.write(w, b'alized"}\n')
        assert lines.next_line(r, 1.0) == b'{"event":"finalized"}'
    finally:
        os.close(r)
        os.close(w)


def test_end_of_stream_and_give_up_end_the_wait_at_once() -> None:
    r, w = os.pipe()
    lines = ChildLines()
    started = time.monotonic()
    assert lines.next_line(r, 30.0, give_up=lambda: True) is None
    os.close(w)
    assert lines.next_line(r, 30.0) is None
    assert time.monotonic() - started < 5.0
    os.close(r)
