"""The export queue's byte bound grows with the job's size."""

from __future__ import annotations

from pathlib import Path

import pytest

from traceml_ai.aggregator import Aggregator, AggregatorConfig
from traceml_ai.export import max_queue_bytes_for
from traceml_ai.export._worker import (
    DEFAULT_MAX_QUEUE_BYTES,
    MAX_QUEUE_BYTES_CAP,
    QUEUE_BYTES_PER_RANK,
)
from traceml_ai.settings import ExportSettings

MIB = 1024 * 1024


@pytest.mark.parametrize(
    ("ranks", "expected"),
    [
        (None, 64 * MIB),
        (0, 64 * MIB),
        (1, 64 * MIB),
        (8192, 64 * MIB),
        (8193, 8193 * 8 * 1024),
        (10240, 80 * MIB),
        (16384, 128 * MIB),
        (32768, 256 * MIB),
        (10**6, 256 * MIB),
    ],
)
def test_the_bound_is_8_kib_a_rank_between_64_and_256_mib(ranks: int | None, expected: int) -> None:
    assert (DEFAULT_MAX_QUEUE_BYTES, QUEUE_BYTES_PER_RANK, MAX_QUEUE_BYTES_CAP) == (
        64 * MIB,
        8 * 1024,
        256 * MIB,
    )
    assert max_queue_bytes_for(ranks) == expected


@pytest.mark.parametrize(
    ("world", "given", "expected"),
    [(16384, None, 128 * MIB), (16384, 5 * MIB, 5 * MIB), (8, None, 64 * MIB)],
)
def test_an_aggregator_sizes_its_queue_by_the_job_unless_told(
    tmp_path: Path, world: int, given: int | None, expected: int
) -> None:
    agg = Aggregator(
        AggregatorConfig(
            run_dir=tmp_path / "run",
            settings=ExportSettings("jsonl", "step_time", False),
            token="bounds-token",
            expected_world_size=world,
            finalize_timeout_sec=0.1,
            max_queue_bytes=given,
        )
    )
    agg.start()
    try:
        pipeline = agg._pipeline
        assert pipeline is not None
        assert pipeline.worker.max_queue_bytes == expected
    finally:
        agg.finalize()
