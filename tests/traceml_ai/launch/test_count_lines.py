"""The launcher's count of exported data lines (what a lost aggregator had written)."""

from __future__ import annotations

from pathlib import Path

import pytest

from traceml_ai.launch import launcher
from traceml_records import _scan


@pytest.mark.parametrize("block", [5, 9, 13, 64, 1 << 20])
def test_closing_lines_are_not_counted_wherever_blocks_cut_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, block: int
) -> None:
    monkeypatch.setattr(_scan, "BLOCK_BYTES", block)
    lines = b"".join(b'{"a":%d}\n' % i for i in range(100))
    (tmp_path / "a.jsonl").write_bytes(lines + b'{"stream":"x","closing":true}\n')
    # A string "closing" is data; the unfinished last line is not a line yet.
    (tmp_path / "b.jsonl").write_bytes(b'{"a":1}\n{"x":"closing"}\n{"partial')
    assert launcher.count_data_lines(tmp_path) == 102


CLOSING = b'{"stream":"step_time","closing":true,"schema_version":1,"written_records":2,"dropped_batches":0}\n'


@pytest.mark.parametrize("block", [7, 1 << 20])
@pytest.mark.parametrize(
    ("files", "closed"),
    [
        ({"a.jsonl": b'{"a":1}\n{"a":2}\n' + CLOSING}, True),
        ({"a.jsonl": b'{"a":1}\n{"a":2}\n' + CLOSING, "b.jsonl": CLOSING}, True),
        ({"a.jsonl": b'{"a":1}\n{"a":2}\n'}, False),
        ({"a.jsonl": b'{"a":1}\n' + CLOSING + b'{"a":3}\n'}, False),
        ({"a.jsonl": b'{"a":1}\n' + CLOSING + b'{"part'}, False),
        ({"a.jsonl": b""}, False),
        ({}, False),
    ],
)
def test_tally_says_whether_every_file_is_closed(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    files: dict[str, bytes],
    closed: bool,
    block: int,
) -> None:
    monkeypatch.setattr(_scan, "BLOCK_BYTES", block)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    assert launcher.export_tally(tmp_path)[1] is closed


def test_an_aggregator_lost_after_closing_the_files_claims_no_export_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "aggregator" / "export"
    export.mkdir(parents=True)
    (export / "step_time.jsonl").write_bytes(b'{"a":1}\n{"a":2}\n' + CLOSING)
    plan = launcher.RunPlan(
        run_dir=tmp_path, start_aggregator=True, bind_host="127.0.0.1",
        connect_host="127.0.0.1", port=1, token="t", world_size=2,
    )  # fmt: skip
    launcher.report_aggregator_lost(plan, "was killed by SIGTERM", 0, export_on=True)
    err = capsys.readouterr().err
    assert "after the export files were closed: the files are complete (2 records)" in err
    assert not (tmp_path / "finalization_warning.json").exists()
    launcher.report_aggregator_lost(plan, "was killed by SIGTERM", 130, export_on=True)
    warning = (tmp_path / "finalization_warning.json").read_text()
    assert '"export"' not in warning and '"missing_ranks"' in warning
