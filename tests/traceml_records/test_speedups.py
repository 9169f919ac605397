"""The C line encoder against the pure-Python one it stands in for.

The C encoder (``traceml_records._speedups``) must give the very bytes of
``_codec._py_dumps_line`` for every record, and hand back to it whatever it does not
handle itself, so that odd values and errors behave the same either way. The Python
path is the oracle here; its own correctness is proved in test_records_roundtrip.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import KINDS, records
from traceml_records import (
    ClosingLine,
    FinalizationWarning,
    PhaseTiming,
    RecordError,
    StdoutStderrRecord,
    StepTimeRecord,
    SystemGpuRecord,
    _codec,
    dumps_line,
    loads_line,
)
from traceml_records._codec import dumps_lines

c_dumps = _codec._c_dumps_line
py_dumps = _codec._py_dumps_line


def test_the_extension_is_built_and_used() -> None:
    # CI builds it (gcc is on every machine here); a silent fallback would leave the
    # C path untested, so its absence is a failure, not a skip.
    assert _codec.SPEEDUPS, "traceml_records._speedups was not built or is disabled"
    assert c_dumps is not None
    assert dumps_line is c_dumps


def _outcome(fn: Any, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    try:
        return "ok", fn(*args, **kwargs)
    except Exception as exc:  # the same type and message either way
        return type(exc).__name__, str(exc)


def same(record: Any, **kwargs: Any) -> tuple[str, Any]:
    assert c_dumps is not None
    c = _outcome(c_dumps, record, **kwargs)
    py = _outcome(py_dumps, record, **kwargs)
    assert c == py
    return c


@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data(), include_hostname=st.booleans())
def test_same_bytes_as_python(kind: str, data: st.DataObject, include_hostname: bool) -> None:
    record = data.draw(records(kind))
    status, line = same(record, include_hostname=include_hostname)
    assert status == "ok"
    if kind != "warning" and (include_hostname or getattr(record, "hostname", None) is None):
        assert loads_line(line) == record


def _timing(ms: float, n_calls: int = 1) -> PhaseTiming:
    return PhaseTiming(cpu_ms=ms, duration_ms=ms, gpu_ms=None, is_gpu=False, n_calls=n_calls)


def _step(**phase: Any) -> StepTimeRecord:
    timing = {"cpu_ms": 1.5, "duration_ms": 1.5, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    timing.update(phase)
    return StepTimeRecord(
        observed_timestamp_unix_ns=1,
        rank=0,
        global_rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        node_rank=0,
        hostname="host-a",
        timestamp_unix_ns=2,
        seq=0,
        step=1,
        events={"_traceml_internal:step_time": {"cpu": PhaseTiming(**timing)}},
    )


FLOATS = [0.0, -0.0, 1.0, 0.1, 1e16, 1e15, 1e-7, 5e-324, 1.7976931348623157e308, 123456.789]


@pytest.mark.parametrize("value", FLOATS)
def test_float_text_is_orjsons(value: float) -> None:
    status, line = same(_step(cpu_ms=value, duration_ms=value))
    assert status == "ok"
    assert float(line.split(b'"cpu_ms":')[1].split(b",")[0]) == value


@pytest.mark.parametrize(
    "phase",
    [
        {"gpu_ms": float("nan")},  # nullable: null
        {"gpu_ms": float("inf")},
        {"cpu_ms": float("nan")},  # not nullable: RecordError from Python
        {"duration_ms": float("-inf")},
        {"cpu_ms": 3},  # an int in a float field: written as Python writes it
        {"n_calls": True},  # a bool in an int field
        {"n_calls": 2**63},  # beyond int64, within orjson's u64
        {"n_calls": 2**64},  # beyond anything: RecordError
        {"n_calls": -(2**63)},
        {"n_calls": 1.0},
        {"is_gpu": 1},
        {"gpu_ms": None, "cpu_ms": None},
    ],
)
def test_odd_values_behave_as_in_python(phase: dict[str, Any]) -> None:
    status, result = same(_step(**phase))
    if "cpu_ms" in phase and phase["cpu_ms"] != phase["cpu_ms"]:
        assert status == "RecordError" and "/events/" in result


class Name(str):
    """A str subclass: not the exact type the C encoder takes."""


@pytest.mark.parametrize(
    "changes",
    [
        {"hostname": 'h\u00e9\U0001f600"\\\n\t\x00\x1f\x7f\u2028'},
        {"hostname": "\ud800"},  # lone surrogate: RecordError
        {"hostname": Name("x")},
        {"hostname": None},
        {"hostname": "x" * 10_000},  # longer than the encoder's stack buffer
        {"stream": 5},
        {"seq": -1},
        {"events": {}},
        {"events": {"b": {"cpu": _timing(1.0)}, "a": {}}},
        {"events": {1: {}, 2: {}}},  # non-str keys
        {"events": {"a": {}, Name("b"): {}}},
        {"events": {"a": {"cpu": {"cpu_ms": 1.0}}}},  # a dict where an object belongs
        {"events": {"a": {"cpu": None}}},
        {"events": [("a", {})]},
        {
            "events": {
                f"event {i:03d}": {f"cuda:{j}": _timing(i + 0.5, j)}
                for i in range(40)
                for j in range(3)
            }
        },  # more floats than the encoder's first float table holds
        {"events": {f"e{i:03d}": {"cpu": _timing(1.5)} for i in range(100)}},  # a big map
    ],
)
def test_odd_records_behave_as_in_python(changes: dict[str, Any]) -> None:
    record = attrs.evolve(_step(), **changes)
    for include_hostname in (False, True):
        same(record, include_hostname=include_hostname)


def test_calls_it_does_not_handle_go_to_python() -> None:
    assert c_dumps is not None
    record = ClosingLine(stream="step_time", written_records=1, dropped_batches=0)
    for args, kwargs in [
        ((), {}),
        ((record, record), {}),
        ((record,), {"hostname": True}),
        ((record,), {"include_hostname": True, "extra": 1}),
        ((object(),), {}),
        (("not a record",), {}),
    ]:
        assert _outcome(c_dumps, *args, **kwargs) == _outcome(py_dumps, *args, **kwargs)
    for truthy in (1, "yes", [0]):
        assert c_dumps(_step(), include_hostname=truthy) == py_dumps(_step(), include_hostname=True)


def test_a_subclass_of_a_record_goes_to_python() -> None:
    @attrs.frozen(kw_only=True)
    class Custom(StdoutStderrRecord):
        pass

    record = Custom(observed_timestamp_unix_ns=1, rank=0, timestamp_unix_ns=1, seq=0,
                    source="stdout", line="x")  # fmt: skip
    same(record)


def test_unset_slot_goes_to_python() -> None:
    record = _step()
    object.__delattr__(record, "seq")
    same(record)


def test_warning_arrays_as_list_or_tuple() -> None:
    warning = FinalizationWarning(
        completed_at="2026-11-29T00:00:00Z",
        reason="ranks_disconnected",
        message="m",
        expected_world_size=3,
        finished_ranks=(0, 1),
        missing_ranks=[2],
    )
    same(warning)


def test_dumps_lines_uses_the_same_encoder() -> None:
    good = _step()
    bad = _step(cpu_ms=float("nan"))
    gpu = SystemGpuRecord(
        observed_timestamp_unix_ns=1, rank=0, global_rank=0, local_rank=0, world_size=1,
        local_world_size=1, node_rank=0, timestamp_unix_ns=1, seq=0, gpu_index=0,
        utilization_percent=float("nan"), memory_used_bytes=1, memory_total_bytes=2,
        temperature_c=None, power_usage_w=1.0, power_limit_w=2.0,
    )  # fmt: skip
    lines, failed = dumps_lines([good, bad, gpu, good], StepTimeRecord, include_hostname=True)
    assert failed == 2
    assert lines == [py_dumps(good, include_hostname=True)] * 2


def test_pure_python_switch() -> None:
    code = (
        "from traceml_records import _codec, dumps_line, ClosingLine;"
        "assert not _codec.SPEEDUPS and dumps_line is _codec._py_dumps_line;"
        "print(dumps_line(ClosingLine(stream='process', written_records=2, dropped_batches=1)))"
    )
    env = {**os.environ, "TRACEML_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    expected = ClosingLine(stream="process", written_records=2, dropped_batches=1)
    assert out.stdout.strip() == repr(dumps_line(expected))


def test_dumps_line_raises_record_error_from_c_too() -> None:
    with pytest.raises(RecordError, match="non-finite"):
        dumps_line(_step(duration_ms=float("nan")))
