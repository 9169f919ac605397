"""The benches' big step_time file (``bench.bigfile``): a valid export of a many-rank
run, written through the real encoder, each (rank, step) once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import orjson

from bench.bigfile import USER_PHASES, write_step_time
from traceml_records import StepTimeRecord, read_jsonl, validate_paths


def test_the_file_is_a_valid_export_of_every_rank(tmp_path: Path) -> None:
    path = tmp_path / "step_time.jsonl"
    lines = 64 * 4 * 3 + 100  # three whole rounds of batches and a partial one
    size = write_step_time(path, lines, world=64)
    assert size == path.stat().st_size

    report = validate_paths([path])
    assert report.ok, report.problems[:3]

    records = [r for r in read_jsonl(path) if isinstance(r, StepTimeRecord)]
    assert len(records) == lines
    keys = Counter((r.global_rank, r.step) for r in records)
    assert max(keys.values()) == 1
    assert {r.global_rank for r in records} == set(range(64))
    assert {r.node_rank for r in records} == set(range(8))
    assert {r.world_size for r in records} == {64}
    assert all(r.events.keys() >= set(USER_PHASES) for r in records)
    # lines differ in their timings, not only in their counters
    assert len({repr(r.events) for r in records}) > lines // 2

    closing = orjson.loads(path.read_bytes().splitlines()[-1])
    assert closing["closing"] is True and closing["written_records"] == lines
