"""The launcher's count of exported data lines (what a lost aggregator had written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from traceml_ai.launch import launcher


@pytest.mark.parametrize("block", [5, 9, 13, 64, 1 << 20])
def test_closing_lines_are_not_counted_wherever_blocks_cut_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(launcher, "BLOCK_BYTES", block)
    lines = b"".join(b'{"a":%d}\n' % i for i in range(100))
    (tmp_path / "a.jsonl").write_bytes(lines + b'{"stream":"x","closing":true}\n')
    # A string "closing" is data; the unfinished last line is not a line yet.
    (tmp_path / "b.jsonl").write_bytes(b'{"a":1}\n{"x":"closing"}\n{"partial')
    assert launcher.count_data_lines(tmp_path) == 102
