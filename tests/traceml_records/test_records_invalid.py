"""Invalid lines: refused by loads_line AND by the validator, both naming the place.

Each case also feeds the schema-level differential: jsonschema_rs (what the validator
uses) must accept and reject exactly what jsonschema's Draft202012Validator does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import pytest

from tests.records_helpers import (
    EXAMPLE_CLOSING_LINE,
    EXAMPLE_DATA_LINE,
    REFERENCE,
    schema_file_for,
)
from traceml_records import RecordError, loads_line, loads_warning_file, validate_line
from traceml_records._codec import record_from_object
from traceml_records._schemas import rs_validators

EV = "_traceml_internal:step_time"
PHASE = f"/events/{EV}/cpu"

STDOUT = {
    "stream": "stdout_stderr",
    "schema_version": 1,
    "observed_timestamp_unix_ns": 5,
    "rank": 0,
    "timestamp_unix_ns": 4,
    "seq": 0,
    "source": "stdout",
    "line": "hello",
}
WARNING = {
    "status": "warning",
    "completed_at": "2025-01-01T00:00:00+00:00",
    "reason": "timeout",
    "message": "Ranks did not finish.",
    "expected_world_size": 2,
    "finished_ranks": [0],
    "missing_ranks": [1],
}
SYSTEM = {
    "stream": "system",
    "schema_version": 1,
    "observed_timestamp_unix_ns": 5,
    "rank": 0,
    "global_rank": 0,
    "local_rank": 0,
    "world_size": 1,
    "local_world_size": 1,
    "node_rank": 0,
    "timestamp_unix_ns": 4,
    "seq": 0,
    "cpu_percent": 12.5,
    "ram_used_bytes": 1,
    "ram_total_bytes": 2,
    "gpu_available": False,
    "gpu_count": 0,
}


def step(change: Callable[[dict[str, Any]], object]) -> bytes:
    d = orjson.loads(EXAMPLE_DATA_LINE)
    change(d)
    return orjson.dumps(d)


def phase(change: Callable[[dict[str, Any]], object]) -> bytes:
    return step(lambda d: change(d["events"][EV]["cpu"]))


def closing(**changes: Any) -> bytes:
    d = orjson.loads(EXAMPLE_CLOSING_LINE)
    d.update(changes)
    return orjson.dumps(d)


def raw_step(old: bytes, new: bytes) -> bytes:
    assert old in EXAMPLE_DATA_LINE
    return EXAMPLE_DATA_LINE.replace(old, new, 1)


def obj(base: dict[str, Any], **changes: Any) -> bytes:
    d = dict(base)
    for key, value in changes.items():
        if value is ...:
            del d[key]
        else:
            d[key] = value
    return orjson.dumps(d)


# (id, line, pointer both must name)
CASES: list[tuple[str, bytes, str]] = [
    ("wrong_type", step(lambda d: d.update(rank=[1])), "/rank"),
    ("string_for_int", step(lambda d: d.update(rank="5")), "/rank"),
    ("fraction_for_int", step(lambda d: d.update(step=1.5)), "/step"),
    ("integral_float_for_int", step(lambda d: d.update(step=1.0)), "/step"),
    ("exponent_for_int", raw_step(b'"step":1,', b'"step":1e0,'), "/step"),
    ("float_for_nested_int", phase(lambda t: t.update(n_calls=1.0)), f"{PHASE}/n_calls"),
    ("missing_field", step(lambda d: d.pop("seq")), "/seq"),
    ("extra_field", step(lambda d: d.update(foo=1)), "/foo"),
    ("extra_nested_field", phase(lambda t: t.update(foo=1)), f"{PHASE}/foo"),
    ("negative_rank", step(lambda d: d.update(rank=-1)), "/rank"),
    ("beyond_int64", raw_step(b'"seq":2,', b'"seq":18446744073709551616,'), "/seq"),
    ("just_beyond_int64", raw_step(b'"seq":2,', b'"seq":9223372036854775808,'), "/seq"),
    ("nan_literal", raw_step(b'"cpu_ms":15.316009521484375', b'"cpu_ms":NaN'), ""),
    ("infinity_literal", raw_step(b'"cpu_ms":15.316009521484375', b'"cpu_ms":Infinity'), ""),
    ("huge_number", raw_step(b'"cpu_ms":15.316009521484375', b'"cpu_ms":1e400'), ""),
    ("negative_float", phase(lambda t: t.update(cpu_ms=-1.0, duration_ms=-1.0)), f"{PHASE}/cpu_ms"),
    ("bool_for_int", step(lambda d: d.update(rank=True)), "/rank"),
    ("int_for_bool", phase(lambda t: t.update(is_gpu=0)), f"{PHASE}/is_gpu"),
    ("null_for_non_nullable", phase(lambda t: t.update(cpu_ms=None)), f"{PHASE}/cpu_ms"),
    ("schema_version_2", step(lambda d: d.update(schema_version=2)), "/schema_version"),
    ("empty_events", step(lambda d: d.update(events={})), "/events"),
    ("empty_device_map", step(lambda d: d["events"].update({EV: {}})), f"/events/{EV}"),
    ("empty_event_name", step(lambda d: d["events"].update({"": d["events"][EV]})), "/events/"),
    ("bad_device_key", step(lambda d: d["events"][EV].update(CPU=d["events"][EV]["cpu"])), f"/events/{EV}/CPU"),
    ("device_key_with_newline", step(lambda d: d["events"][EV].update({"cpu\n": d["events"][EV]["cpu"]})), f"/events/{EV}/cpu\n"),
    ("reserved_prefix", step(lambda d: d["events"].update({"_traceml_internal:mine": d["events"][EV]})), "/events/_traceml_internal:mine"),
    ("unknown_stream", step(lambda d: d.update(stream="bogus")), "/stream"),
    ("missing_stream", step(lambda d: d.pop("stream")), "/stream"),
    ("data_line_with_closing_false", step(lambda d: d.update(closing=False)), "/closing"),
    ("hostname_on_stdout_stderr", obj(STDOUT, hostname="h"), "/hostname"),
    ("stdout_bad_source", obj(STDOUT, source="stdin"), "/source"),
    ("system_cpu_percent_above_100", obj(SYSTEM, cpu_percent=100.5), "/cpu_percent"),
    ("system_string_bool", obj(SYSTEM, gpu_available="false"), "/gpu_available"),
    ("closing_false", closing(closing=False), "/closing"),
    ("closing_stream_all", closing(stream="all"), "/stream"),
    ("closing_negative_count", closing(written_records=-1), "/written_records"),
    ("closing_with_hostname", closing(hostname=None), "/hostname"),
    ("closing_float_count", closing(dropped_batches=0.0), "/dropped_batches"),
    ("warning_missing_ranks_empty", obj(WARNING, missing_ranks=[]), "/missing_ranks"),
    ("warning_duplicate_ranks", obj(WARNING, finished_ranks=[0, 0]), "/finished_ranks"),
    ("warning_ranks_without_world", obj(WARNING, expected_world_size=...), "/expected_world_size"),
    ("warning_timeout_without_ranks", obj(WARNING, expected_world_size=..., finished_ranks=..., missing_ranks=...), "/expected_world_size"),
    ("warning_export_incomplete_without_export", obj(WARNING, reason="export_incomplete", expected_world_size=..., finished_ranks=..., missing_ranks=...), "/export"),
    ("warning_bad_status", obj(WARNING, status="error"), "/status"),
    ("warning_empty_message", obj(WARNING, message=""), "/message"),
    ("not_an_object", b"[1, 2]", ""),
    ("a_number", b"5", ""),
    ("truncated_json", EXAMPLE_DATA_LINE[:40], ""),
    ("invalid_utf8", b'{"stream":"\xff"}', ""),
]  # fmt: skip


@pytest.mark.parametrize(("line", "pointer"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_by_loads_line_and_the_validator(line: bytes, pointer: str) -> None:
    with pytest.raises(RecordError) as info:
        loads_line(line)
    assert info.value.pointer == pointer
    assert str(info.value).startswith(f"{pointer or '/'}: ")
    problems = validate_line(line)
    assert problems, "the validator accepted an invalid line"
    assert pointer in [p.pointer for p in problems], [str(p) for p in problems]
    assert any(str(p).startswith(f"{pointer or '/'}: ") for p in problems)


@pytest.mark.parametrize("line", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_both_schema_validators_agree_on_invalid_cases(line: bytes) -> None:
    try:
        d = orjson.loads(line)
    except orjson.JSONDecodeError:
        return  # not JSON: neither schema validator gets to see it
    schema_file = schema_file_for(d)
    if schema_file is None:
        return  # not an object, or no such stream: no schema applies
    reference = REFERENCE[schema_file].is_valid(d)
    if any(_ends_with_newline(k) for k in _keys(d)):
        # Python's re treats "$" as matching before a final newline; ECMA does not.
        assert reference is True and rs_validators()[schema_file].is_valid(d) is False
        return
    assert rs_validators()[schema_file].is_valid(d) == reference


def test_the_differential_sees_integral_floats_as_integers() -> None:
    # Why the validator checks integer spelling itself: JSON Schema accepts 1.0.
    d = orjson.loads(step(lambda d: d.update(step=1.0)))
    assert REFERENCE["step_time.schema.json"].is_valid(d)
    assert rs_validators()["step_time.schema.json"].is_valid(d)


def _keys(d: Any) -> list[str]:
    if isinstance(d, dict):
        return [*d, *(k for v in d.values() for k in _keys(v))]
    if isinstance(d, list):
        return [k for v in d for k in _keys(v)]
    return []


def _ends_with_newline(key: str) -> bool:
    return key.endswith("\n")


def test_warning_file_loader_applies_the_schema_rules() -> None:
    with pytest.raises(RecordError) as info:
        loads_warning_file(obj(WARNING, reason="export_incomplete"))
    # export_incomplete never carries ranks and always carries the export block.
    assert info.value.pointer in ("/export", "/missing_ranks", "")
    assert loads_warning_file(orjson.dumps(WARNING)).missing_ranks == (1,)


def test_record_from_object_dispatch() -> None:
    assert type(record_from_object(orjson.loads(EXAMPLE_CLOSING_LINE))).__name__ == "ClosingLine"
    assert type(record_from_object(dict(WARNING))).__name__ == "FinalizationWarning"
    with pytest.raises(RecordError, match="unknown stream integer 5; expected one of step_time"):
        record_from_object({"stream": 5})
