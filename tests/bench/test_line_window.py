"""The update clock's line count (``bench/overhead/workloads/update_clock.py``,
``LINE_WINDOW``): what ``python -m bench.overhead.lines`` reads. Only the updates inside the window count,
each call and each line executed once."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from bench.overhead.workloads.update_clock import LINE_WINDOW, StartClock


def _update(n: int) -> int:
    total = 0
    for i in range(n):
        total += i
    return total


def test_the_window_counts_the_lines_of_its_updates_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "lines.json"
    monkeypatch.setenv(LINE_WINDOW, f"2,5,{out}")
    clock = StartClock(_update)
    sizes = [100, 100, 3, 3, 3, 100, 100]
    for n in sizes:
        clock(n)
    counts = {(name, line): n for _, name, line, n in orjson.loads(out.read_bytes())}
    # Updates 2, 3 and 4 (n=3): the call, the first line, 4 loop heads, 3 bodies,
    # the return: 10 each.
    assert counts[("_update", _update.__code__.co_firstlineno)] == 3 * 10
