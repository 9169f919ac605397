"""The soak with garbage on the aggregator port, small (``bench/soak.py``, ``python -m
bench.soak``): three real 2-rank runs, each judged, and the judging itself on files
written here.

No assertion on timing: the soak's figures are counts.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench import soak
from traceml_ai.transport.wire import FRAME_HEADER

STEPS = 3


def _write_run(
    run_dir: Path,
    keys: list[tuple[int, int]],
    *,
    dropped: int = 0,
    closing: bool = True,
    warning: dict[str, object] | None = None,
) -> None:
    export = run_dir / "aggregator" / "export"
    export.mkdir(parents=True)
    lines = [
        orjson.dumps({"stream": "step_time", "global_rank": rank, "step": step})
        for rank, step in keys
    ]
    if closing:
        lines.append(
            orjson.dumps(
                {
                    "stream": "step_time",
                    "closing": True,
                    "schema_version": 1,
                    "written_records": len(keys),
                    "dropped_batches": dropped,
                }
            )
        )
    (export / "step_time.jsonl").write_bytes(b"".join(line + b"\n" for line in lines))
    if warning is not None:
        (run_dir / "finalization_warning.json").write_bytes(orjson.dumps(warning))


ALL = [(r, s) for r in range(2) for s in range(1, STEPS + 1)]


def test_a_complete_run_is_ok(tmp_path: Path) -> None:
    _write_run(tmp_path, ALL)
    outcome = soak.judge(tmp_path, 0, "", steps=STEPS)
    assert (outcome.verdict, outcome.present, outcome.expected) == ("ok", 6, 6)


def test_missing_lines_without_a_report_are_lost_unreported(tmp_path: Path) -> None:
    _write_run(tmp_path, ALL[:-2])
    outcome = soak.judge(tmp_path, 0, "", steps=STEPS)
    assert (outcome.verdict, outcome.present) == ("lost_unreported", 4)
    # Only a loss of the files counts as reported: the live views' warning does not.
    live = {"reason": "monitoring_incomplete", "message": "x", "monitoring": {}}
    _write_run(tmp_path / "live", ALL[:-2], warning=live)
    assert soak.judge(tmp_path / "live", 0, "", steps=STEPS).verdict == "lost_unreported"


@pytest.mark.parametrize(
    "report",
    [
        {"dropped": 1},
        {"warning": {"reason": "export_incomplete", "message": "x", "export": {}}},
        {"warning": {"reason": "ranks_disconnected", "message": "x", "missing_ranks": [1]}},
    ],
)
def test_missing_lines_with_a_report_are_reported(tmp_path: Path, report: dict[str, Any]) -> None:
    _write_run(tmp_path, ALL[:3], **report)
    assert soak.judge(tmp_path, 0, "", steps=STEPS).verdict == "reported"


def test_a_bad_exit_a_traceback_or_a_damaged_file_is_failed(tmp_path: Path) -> None:
    _write_run(tmp_path, ALL)
    assert soak.judge(tmp_path, 1, "", steps=STEPS).verdict == "failed"
    assert soak.judge(tmp_path, 0, "Traceback (most recent", steps=STEPS).verdict == "failed"
    _write_run(tmp_path / "open", ALL, closing=False)
    outcome = soak.judge(tmp_path / "open", 0, "", steps=STEPS)
    assert outcome.verdict == "failed" and outcome.problems == ["step_time.jsonl: no closing line"]
    _write_run(tmp_path / "twice", [*ALL, ALL[0]])
    assert soak.judge(tmp_path / "twice", 0, "", steps=STEPS).verdict == "failed"


def test_every_kind_of_garbage_is_what_it_says() -> None:
    rng = random.Random(0)
    assert soak.garbage("hang", rng) is None
    for _ in range(50):
        wrong = soak.garbage("wrong_length", rng)
        assert wrong is not None
        assert FRAME_HEADER.unpack_from(wrong)[0] != len(wrong) - FRAME_HEADER.size
        huge = soak.garbage("huge_length", rng)
        assert huge is not None and FRAME_HEADER.unpack_from(huge)[0] >= 1 << 24
        cut = soak.garbage("truncated", rng)
        assert cut is not None
        if len(cut) >= FRAME_HEADER.size:  # else cut inside the header itself
            assert len(cut) < FRAME_HEADER.size + FRAME_HEADER.unpack_from(cut)[0]


@pytest.mark.slow
def test_a_run_with_garbage_on_the_port_loses_nothing_unreported(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # One run through the bench's loop and totals; the 100-run soak is the bench's own.
    status = soak.main(["--runs", "1", "--steps", "10", "--sleep-ms", "50"])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2, out
    assert out[-1].startswith("soak_runs=1 lost_unreported=0 failed=0 "), out
    assert status == 0
    for line in out[:1]:
        fields = dict(part.split("=", 1) for part in line.split(" ") if "=" in part)
        assert fields["verdict"] in ("ok", "reported"), line
        assert int(fields["garbage_conns"]) > 0, line
