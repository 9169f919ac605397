"""The fields of issue 42 on the line format: runtime_environment's ``parallel`` and
``parallel_source``, collectives' ``group``, ``peer_rank``, ``peer_stage`` and
``bytes``, step_time's ``tokens``.

Lines written before them (without the keys) still validate and load; the
always-written ones come back as ``null`` when such a record is dumped, ``tokens`` stays
absent; a coordinate whose rank is not below its size is reported by ``traceml
validate`` and refused by strict loads; the C encoder writes the same bytes as the
pure-Python one for records carrying them.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.strategies import consistent_json
from traceml_records import (
    RecordError,
    RuntimeEnvironmentRecord,
    StepTimeRecord,
    dumps_line,
    loads_line,
    validate_line,
)
from traceml_records._codec import _py_dumps_line
from traceml_records._fastcheck import core_for, keys_for
from traceml_records._generated.checks import CHECKS
from traceml_records._generated.records import CollectivesRecord

pytestmark = pytest.mark.unit

_IDENTITY: dict[str, Any] = {
    "observed_timestamp_unix_ns": 5,
    "rank": 1,
    "global_rank": 1,
    "local_rank": 1,
    "world_size": 4,
    "local_world_size": 4,
    "node_rank": 0,
}
_STEP = {
    "_traceml_internal:step_time": {
        "cpu": {"cpu_ms": 2.0, "duration_ms": 2.0, "gpu_ms": None, "is_gpu": False, "n_calls": 1}
    }
}


def _step(**extra: Any) -> dict[str, Any]:
    return {
        "stream": "step_time",
        "schema_version": 1,
        **_IDENTITY,
        "timestamp_unix_ns": 7,
        "seq": 0,
        "step": 1,
        "events": _STEP,
        **extra,
    }


def _collective(**extra: Any) -> dict[str, Any]:
    return {
        "stream": "collectives",
        "schema_version": 1,
        **_IDENTITY,
        "timestamp_unix_ns": 7,
        "seq": 0,
        "step": 1,
        "phase": "_traceml_internal:backward_time",
        "op": "all_reduce",
        "source": "torch.distributed",
        "backend": "gloo",
        "n_calls": 2,
        "wait_ms": 1.5,
        "wait_measure": "host",
        "first_arrival_ms": 0.5,
        "last_arrival_ms": 0.75,
        **extra,
    }


def _runtime(**extra: Any) -> dict[str, Any]:
    return {
        "stream": "runtime_environment",
        "schema_version": 1,
        **_IDENTITY,
        "timestamp_unix_ns": 7,
        "seq": 0,
        "pid": 10,
        "topology": "single_node_multi_process",
        "distributed_initialized": True,
        "distributed_backend": "gloo",
        "training_strategy": "ddp",
        "strategy_source": "runtime_model",
        "strategy_confidence": "high",
        "torch_version": "2.5.0",
        "python_version": "3.11.7",
        **extra,
    }


def _raw(d: dict[str, Any]) -> bytes:
    return orjson.dumps(d) + b"\n"


_LAYOUT = {"dp": {"rank": 1, "size": 2}, "tp": {"rank": 0, "size": 2}}


# ------------------------------------------------------------------- old lines


@pytest.mark.parametrize("line", [_step(), _collective(), _runtime()])
def test_lines_without_the_new_keys_still_validate_and_load(line: dict[str, Any]) -> None:
    raw = _raw(line)
    assert validate_line(raw) == []
    record = loads_line(raw)
    for name in ("tokens", "group", "peer_rank", "peer_stage", "bytes", "parallel"):
        if hasattr(record, name):
            assert getattr(record, name) is None


def test_an_old_record_is_dumped_with_the_always_written_keys_as_null() -> None:
    runtime = orjson.loads(dumps_line(loads_line(_raw(_runtime()))))
    assert runtime["parallel"] is None and runtime["parallel_source"] is None
    collective = orjson.loads(dumps_line(loads_line(_raw(_collective()))))
    # group cannot be null: a record without it (from an old line) leaves it out
    assert "group" not in collective
    assert collective["peer_rank"] is None and collective["bytes"] is None
    step = orjson.loads(dumps_line(loads_line(_raw(_step()))))
    assert "tokens" not in step  # written only when known


def test_new_lines_round_trip_byte_for_byte() -> None:
    lines = [
        _step(tokens=4096),
        _collective(group="pp", peer_rank=3, peer_stage=1, bytes=1 << 20, op="send"),
        _collective(group="dp", peer_rank=None, peer_stage=None, bytes=None),
        _runtime(parallel=_LAYOUT, parallel_source="declared"),
        _runtime(parallel=None, parallel_source=None),
    ]
    for line in lines:
        raw = _raw(line)
        assert validate_line(raw) == [], line
        record = loads_line(raw)
        assert dumps_line(record) == raw
        assert _py_dumps_line(record) == raw  # the pure-Python encoder too


def test_a_null_tokens_reads_as_unknown() -> None:
    raw = _raw(_step(tokens=None))
    assert validate_line(raw) == []
    record = loads_line(raw)
    assert isinstance(record, StepTimeRecord) and record.tokens is None


# ------------------------------------------------------------------- rules


def test_a_rank_not_below_its_size_is_reported_and_refused() -> None:
    raw = _raw(_runtime(parallel={"pp": {"rank": 4, "size": 4}}, parallel_source="megatron"))
    problems = validate_line(raw)
    assert [p.pointer for p in problems] == ["/parallel/pp/rank"]
    assert "not below size" in problems[0].message
    with pytest.raises(RecordError, match="not below size"):
        loads_line(raw)


def test_a_hand_built_record_with_a_bad_coordinate_is_refused_by_dumps_line() -> None:
    import attrs

    from traceml_records import ParallelCoordinate

    good = loads_line(_raw(_runtime(parallel=_LAYOUT, parallel_source="declared")))
    assert isinstance(good, RuntimeEnvironmentRecord)
    bad = attrs.evolve(good, parallel={"dp": ParallelCoordinate(rank=2, size=2)})
    with pytest.raises(RecordError, match="not below size"):
        dumps_line(bad)


@pytest.mark.parametrize(
    ("parallel", "source"), [(_LAYOUT, None), (None, "device_mesh"), (_LAYOUT, "absent")]
)
def test_parallel_source_is_null_exactly_when_parallel_is(parallel: Any, source: Any) -> None:
    line = _runtime(parallel=parallel)
    if source != "absent":
        line["parallel_source"] = source
    problems = validate_line(_raw(line))
    assert [p.pointer for p in problems] == ["/parallel_source"]
    with pytest.raises(RecordError):
        loads_line(_raw(line))


@pytest.mark.parametrize(
    ("key", "value"),
    [("parallel", {}), ("parallel", {"DP": {"rank": 0, "size": 1}}), ("group", "mesh"),
     ("group", None), ("peer_rank", -1), ("bytes", -1), ("tokens", -1), ("tokens", 1.5)],
)  # fmt: skip
def test_values_out_of_the_schema_are_refused(key: str, value: Any) -> None:
    if key == "tokens":
        line = _step(**{key: value})
    elif key == "parallel":
        line = _runtime(**{key: value}, parallel_source="declared")
    else:
        line = _collective(**{key: value})
    assert validate_line(_raw(line)) != []
    with pytest.raises(RecordError):
        loads_line(_raw(line))


# ------------------------------------------------------------------- keys


def test_collectives_keys_include_group_and_peer_rank() -> None:
    """Two lines differing only in peer_rank (or group) are two keys; the same key twice
    is a duplicate, also where both lines lack the new keys (old files)."""
    assert CHECKS["collectives"].key_shape == "iisssn"
    send = [
        _collective(group="pp", peer_rank=p, peer_stage=p, bytes=8, op="send", seq=p)
        for p in (0, 2)
    ]
    assert all(validate_line(_raw(d)) == [] for d in send)
    core = core_for("collectives")
    data = b"".join(_raw(d) for d in send)
    keys = keys_for("collectives")
    assert core.scan(data, 0, len(data), keys, 0) == (len(data), 2)
    again = _raw(send[0] | {"seq": 5})
    pos, lines = core.scan(again, 0, len(again), keys, 0)
    assert (pos, lines) == (0, 0)  # a repeated key: left to the scan's own step


def test_both_keys_and_seqs_agree_on_null_key_components() -> None:
    from traceml_records._scan_py import KeysAndSeqs

    shape = CHECKS["collectives"].key_shape
    for tracker in (keys_for("collectives"), KeysAndSeqs(shape)):
        assert tracker.add((0, 1, "p", "all_reduce", "dp", None), 1)
        assert tracker.add((0, 1, "p", "all_reduce", None, None), 2)
        assert tracker.add((0, 1, "p", "send", "pp", 3), 3)
        assert not tracker.add((0, 1, "p", "all_reduce", "dp", None), 4)
        assert not tracker.add((0, 1, "p", "all_reduce", None, None), 5)


def test_validate_finds_a_duplicate_of_old_collectives_lines(tmp_path: Any) -> None:
    from traceml_records import validate_paths

    path = tmp_path / "collectives.jsonl"
    path.write_bytes(_raw(_collective()) + _raw(_collective(seq=1)))
    report = validate_paths([path])
    assert any("duplicate key" in str(p) for p in report.problems)


# ------------------------------------------------------------------- C and Python


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_c_and_python_encoders_agree_on_the_new_fields(data: st.DataObject) -> None:
    stream = data.draw(st.sampled_from(["step_time", "collectives", "runtime_environment"]))
    d = data.draw(consistent_json(stream))
    record = loads_line(_raw(d))
    for hostname in (False, True):
        assert dumps_line(record, include_hostname=hostname) == _py_dumps_line(
            record, include_hostname=hostname
        )


def test_records_built_by_hand_carry_the_new_fields() -> None:
    record = loads_line(_raw(_collective(group="tp", peer_rank=None, peer_stage=None, bytes=64)))
    assert isinstance(record, CollectivesRecord)
    assert (record.group, record.peer_rank, record.peer_stage, record.bytes) == (
        "tp",
        None,
        None,
        64,
    )


# ------------------------------------------------------------------- frames


def test_frames_read_tokens_and_the_parallel_table(tmp_path: Any) -> None:
    pa = pytest.importorskip("pyarrow")
    from traceml_records import frames

    steps = tmp_path / "step_time.jsonl"
    steps.write_bytes(_raw(_step(tokens=10)) + _raw(_step(step=2, seq=1)))
    loaded = frames.load(steps, "step_time", validate=True)
    assert loaded.tables["step_time"].column("tokens").to_pylist() == [10, None]

    runtime = tmp_path / "runtime_environment.jsonl"
    runtime.write_bytes(
        _raw(_runtime(parallel=None, parallel_source=None))
        + _raw(_runtime(seq=1, parallel=_LAYOUT, parallel_source="declared"))
    )
    loaded = frames.load(runtime, "runtime_environment", validate=True)
    table = loaded.tables["runtime_environment_parallel"]
    assert table.schema.names == ["global_rank", "dimension", "rank", "size"]
    rows = sorted(table.to_pylist(), key=lambda r: r["dimension"])
    assert rows == [
        {"global_rank": 1, "dimension": "dp", "rank": 1, "size": 2},
        {"global_rank": 1, "dimension": "tp", "rank": 0, "size": 2},
    ]
    assert table.schema.field("rank").type == pa.int64()
    only_null = tmp_path / "null" / "runtime_environment.jsonl"
    only_null.parent.mkdir()
    only_null.write_bytes(_raw(_runtime(parallel=None, parallel_source=None)))
    loaded = frames.load(only_null, "runtime_environment")
    assert loaded.tables["runtime_environment_parallel"].num_rows == 0
