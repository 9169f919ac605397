"""step_time's ``tokens`` in the run summary's step rows: ``_tokens`` (a float) when the
line has tokens, none when it lacks them or has null, the same through the C reader
(``_rowscan``) and its Python twin."""

from __future__ import annotations

from typing import Any

import pytest

from traceml_ai.run_summary._phases import STEP_EVENT, phase_name
from traceml_ai.run_summary._read import _checks
from traceml_ai.run_summary._read import step_line as py_step_line
from traceml_records.internal import load_extension

pytestmark = pytest.mark.unit

_rowscan = load_extension("traceml_ai.run_summary._rowscan")


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


def _readers() -> list[Any]:
    readers: list[Any] = [
        lambda obj: py_step_line(obj, _checks("step_time"), STEP_EVENT, phase_name, {})
    ]
    if _rowscan is not None:
        readers.append(
            lambda obj: _rowscan.step_line(
                obj, _checks("step_time"), STEP_EVENT, phase_name, {}, {}, set()
            )
        )
    return readers


@pytest.mark.parametrize("reader", range(2))
@pytest.mark.parametrize(
    ("extra", "expected"),
    [({"tokens": 2048}, 2048.0), ({"tokens": 0}, 0.0), ({"tokens": None}, None), ({}, None)],
)
def test_tokens_reach_the_step_row(reader: int, extra: dict[str, Any], expected: Any) -> None:
    readers = _readers()
    if reader >= len(readers):
        pytest.skip("the C reader was not built")
    found = readers[reader](_line(**extra))
    assert isinstance(found, tuple)
    row = found[4]
    assert row.get("_tokens") == expected
    if expected is not None:
        assert type(row["_tokens"]) is float


@pytest.mark.parametrize("bad", [-1, 1.5, "12", True])
def test_bad_tokens_are_refused_alike(bad: Any) -> None:
    results = [read(_line(tokens=bad)) for read in _readers()]
    assert results[0] == 1  # a scalar field is wrong
    assert all(r == results[0] for r in results)
