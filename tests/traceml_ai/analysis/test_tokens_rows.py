"""step_time's ``tokens`` in the run summary's step rows: ``tokens`` (a float) when the
line has tokens, none when it lacks them or has null, the same through the scan's C
core and its pure-Python twin."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from tests.traceml_ai.analysis.test_reader import _step_columns
from traceml_ai.analysis._phases import STEP_EVENT

pytestmark = pytest.mark.unit


def _line(**extra: Any) -> dict[str, Any]:
    timing = {"cpu_ms": 4.0, "duration_ms": 4.0, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    return {
        "stream": "step_time",
        "schema_version": 1,
        "observed_timestamp_unix_ns": 1,
        "rank": 0,
        "global_rank": 0,
        "local_rank": 0,
        "world_size": 2,
        "local_world_size": 2,
        "node_rank": 0,
        "timestamp_unix_ns": 1_000,
        "seq": 0,
        "step": 3,
        "events": {STEP_EVENT: {"cpu": timing}},
        **extra,
    }


@pytest.mark.parametrize("pure", [False, True])
@pytest.mark.parametrize(
    ("extra", "expected"),
    [({"tokens": 2048}, 2048.0), ({"tokens": 0}, 0.0), ({"tokens": None}, None), ({}, None)],
)
def test_tokens_reach_the_step_row(pure: bool, extra: dict[str, Any], expected: Any) -> None:
    columns = _step_columns(orjson.dumps(_line(**extra)) + b"\n", pure=pure)
    row = columns[0].row(0)
    assert row.tokens == expected
    if expected is not None:
        assert type(row.tokens) is float


@pytest.mark.parametrize("bad", [-1, 1.5, "12", True])
def test_bad_tokens_are_refused_alike(bad: Any) -> None:
    data = orjson.dumps(_line(tokens=bad)) + b"\n"
    assert _step_columns(data, pure=False) == _step_columns(data, pure=True) == {}
