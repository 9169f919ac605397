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


def test_the_sampler_files_are_a_valid_export_of_every_rank_node_and_gpu(tmp_path: Path) -> None:
    from bench.bigfile import write_process
    from traceml_records._generated.records import ProcessRecord, SystemGpuRecord, SystemRecord

    lines = 32 * 5 + 7  # five whole snapshots of 32 ranks and a partial one
    counts = write_process(tmp_path, lines, world=32, ranks_per_node=8)
    assert counts == {"process": lines, "system": 6 * 4, "system_gpu": 6 * 4 * 8}
    paths = [tmp_path / f"{name}.jsonl" for name in counts]
    report = validate_paths(paths)
    assert report.ok, report.problems[:3]
    process = [r for r in read_jsonl(paths[0]) if isinstance(r, ProcessRecord)]
    system = [r for r in read_jsonl(paths[1]) if isinstance(r, SystemRecord)]
    gpus = [r for r in read_jsonl(paths[2]) if isinstance(r, SystemGpuRecord)]
    assert Counter(r.global_rank for r in process) == {r: 6 if r < 7 else 5 for r in range(32)}
    assert {(r.node_rank, r.seq) for r in system} == {(n, s) for n in range(4) for s in range(6)}
    assert {(r.node_rank, r.gpu_index) for r in gpus} == {
        (n, i) for n in range(4) for i in range(8)
    }
    # the figures vary from line to line
    assert len({r.cpu_percent for r in process}) > lines // 2
    assert len({r.power_usage_w for r in gpus}) > len(gpus) // 2
