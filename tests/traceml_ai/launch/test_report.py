"""The end of ``traceml run`` (``traceml_ai.launch._report``): what it prints."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from traceml_ai.launch import _report


def test_a_big_export_names_a_summary_command_a_shell_can_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / 'it\'s my "run" $HOME'
    export_dir = run_dir / "aggregator" / "export"
    export_dir.mkdir(parents=True)
    (export_dir / "step_time.jsonl").write_bytes(b"x" * 4096)
    monkeypatch.setattr(_report, "END_OF_RUN_SUMMARY_MAX_BYTES", 1024)
    _report._print_short_summary(run_dir, export_dir)
    (line,) = capsys.readouterr().err.splitlines()
    command = line.split("`")[1]
    assert shlex.split(command) == ["traceml", "summary", str(run_dir)], line
