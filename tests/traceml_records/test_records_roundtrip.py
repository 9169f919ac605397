"""Record → line → record, for every stream, the closing line and the warning file.

Every serialized line must validate against its schema with jsonschema's
Draft202012Validator (the reference implementation, not the fast one the validator
uses): this is what ties the generated classes to the schemas.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import orjson
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tests.records_helpers import EXAMPLE_CLOSING_LINE, EXAMPLE_DATA_LINE, REFERENCE
from tests.strategies import KINDS, STREAM_FILES, records
from traceml_records import (
    STREAMS_BY_NAME,
    ClosingLine,
    ExportLoss,
    FinalizationWarning,
    PhaseTiming,
    ProcessRecord,
    RecordError,
    StepTimeRecord,
    SystemGpuRecord,
    dumps_line,
    dumps_warning_file,
    loads_line,
    loads_warning_file,
    validate_line,
)
from traceml_records._schemas import (
    CLOSING_SCHEMA_FILE,
    WARNING_SCHEMA_FILE,
    schema_documents,
)

# Every test runs with the C encoder and with the pure-Python one (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("encoder")


def schema_file_of(kind: str) -> str:
    if kind == "closing":
        return CLOSING_SCHEMA_FILE
    if kind == "warning":
        return WARNING_SCHEMA_FILE
    return STREAM_FILES[kind]


def _hostname_expected(kind: str, include_hostname: bool) -> bool:
    spec = STREAMS_BY_NAME.get(kind)
    return include_hostname and spec is not None and spec.carries_hostname


@pytest.mark.parametrize("include_hostname", [False, True], ids=["no_hostname", "hostname"])
@pytest.mark.parametrize("kind", KINDS)
@given(data=st.data())
def test_record_line_record_roundtrip(
    kind: str, include_hostname: bool, data: st.DataObject
) -> None:
    record = data.draw(records(kind))
    # The warning rule "message-not-blank": the shared strategy may draw " " or "\r".
    assume(kind != "warning" or record.message.strip())
    line = dumps_line(record, include_hostname=include_hostname)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    obj = orjson.loads(line)
    schema_file = schema_file_of(kind)
    REFERENCE[schema_file].validate(obj)
    # Keys in schema order, and only the hostname the setting asks for.
    props = list(schema_documents()[schema_file]["properties"])
    assert list(obj) == [k for k in props if k in obj]
    assert ("hostname" in obj) == _hostname_expected(kind, include_hostname)
    if kind == "step_time":
        assert list(obj["events"]) == sorted(obj["events"])
        assert all(list(devs) == sorted(devs) for devs in obj["events"].values())
    assert validate_line(line) == []
    back = loads_line(line)
    if "hostname" not in obj and hasattr(record, "hostname"):
        record = attrs.evolve(record, hostname=None)
    assert back == record
    assert dumps_line(back, include_hostname=include_hostname) == line


@given(warning=records("warning"))
def test_warning_file_roundtrip(warning: FinalizationWarning) -> None:
    assume(warning.message.strip())  # "message-not-blank"; the strategy may draw " "
    text = dumps_warning_file(warning)
    assert text.endswith(b"}\n") and b'\n  "status": "warning",\n' in text
    REFERENCE[WARNING_SCHEMA_FILE].validate(orjson.loads(text))
    back = loads_warning_file(text)
    assert back == warning
    assert dumps_warning_file(back) == text


def test_example_lines_of_the_user_guide() -> None:
    data = loads_line(EXAMPLE_DATA_LINE)
    closing = loads_line(EXAMPLE_CLOSING_LINE)
    assert type(data) is StepTimeRecord and data.rank == 1 and data.step == 1
    assert data.events["_traceml_internal:step_time"]["cpu"].gpu_ms is None
    assert closing == ClosingLine(stream="step_time", written_records=8, dropped_batches=0)
    for line, schema_file in (
        (EXAMPLE_DATA_LINE, "step_time.schema.json"),
        (EXAMPLE_CLOSING_LINE, CLOSING_SCHEMA_FILE),
    ):
        REFERENCE[schema_file].validate(orjson.loads(line))
        assert validate_line(line) == []
    assert dumps_line(data) == EXAMPLE_DATA_LINE
    assert dumps_line(closing) == EXAMPLE_CLOSING_LINE
    assert loads_line(EXAMPLE_DATA_LINE.decode()) == data  # str input works too


def _phase(**changes: Any) -> PhaseTiming:
    values: dict[str, Any] = dict(cpu_ms=1.0, duration_ms=1.0, gpu_ms=None, is_gpu=False, n_calls=1)
    values.update(changes)
    return PhaseTiming(**values)


def _step(events: dict[str, dict[str, PhaseTiming]], **changes: Any) -> StepTimeRecord:
    """The example record with these events (plus the whole-step event every line has)."""
    record = loads_line(EXAMPLE_DATA_LINE)
    assert type(record) is StepTimeRecord
    events = {"_traceml_internal:step_time": {"cpu": _phase()}, **events}
    return attrs.evolve(record, events=events, **changes)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["cpu_ms", "duration_ms"])
def test_non_finite_in_a_non_nullable_float_is_refused(field: str, bad: float) -> None:
    record = _step({"_traceml_internal:step_time": {"cpu": _phase(**{field: bad})}})
    with pytest.raises(RecordError) as info:
        dumps_line(record)
    assert info.value.pointer == f"/events/_traceml_internal:step_time/cpu/{field}"
    assert "non-finite" in str(info.value)


def test_non_finite_in_a_nullable_float_is_written_as_null() -> None:
    record = _step({"a": {"cpu": _phase(gpu_ms=math.nan)}})
    line = dumps_line(record)
    assert b'"gpu_ms":null' in line
    assert validate_line(line) == []
    gpu = loads_line(
        b'{"stream":"system_gpu","schema_version":1,"observed_timestamp_unix_ns":1,"rank":0,'
        b'"global_rank":0,"local_rank":0,"world_size":1,"local_world_size":1,"node_rank":0,'
        b'"timestamp_unix_ns":1,"seq":0,"gpu_index":0,"utilization_percent":null,'
        b'"memory_used_bytes":null,"memory_total_bytes":null,"temperature_c":null,'
        b'"power_usage_w":null,"power_limit_w":null}'
    )
    assert type(gpu) is SystemGpuRecord
    hot = attrs.evolve(gpu, temperature_c=math.inf, power_usage_w=-math.inf)
    assert loads_line(dumps_line(hot)) == gpu


def test_non_finite_process_cpu_percent_is_refused() -> None:
    record = ProcessRecord(
        observed_timestamp_unix_ns=1, rank=0, global_rank=0, local_rank=0, world_size=1,
        local_world_size=1, node_rank=0, timestamp_unix_ns=1, seq=0, pid=1,
        cpu_percent=math.nan, cpu_logical_cores=None, ram_used_bytes=0, ram_total_bytes=None,
        gpu_available=None, gpu_count=None, gpu_device_index=None, gpu_memory_used_bytes=None,
        gpu_memory_reserved_bytes=None, gpu_memory_total_bytes=None,
    )  # fmt: skip
    with pytest.raises(RecordError) as info:
        dumps_line(record)
    assert info.value.pointer == "/cpu_percent"


def test_a_device_key_spelled_like_a_marker_is_not_a_false_alarm() -> None:
    # The null-marker scan is only a hint; a hit without a non-finite value passes.
    record = _step({'x"cpu_ms': {"cpu": _phase()}}, hostname='"cpu_ms":null')
    line = dumps_line(record, include_hostname=True)
    assert loads_line(line) == record


def test_unwritable_values_raise_record_error() -> None:
    with pytest.raises(RecordError, match="cannot be serialized"):
        dumps_line(_step({"a": {"cpu": _phase()}}, seq=2**64))
    with pytest.raises(RecordError, match="cannot be serialized"):
        dumps_line(_step({"a": {"cpu": _phase()}}, hostname="\ud800"), include_hostname=True)


def test_hostname_only_when_asked_and_carried() -> None:
    record = _step({"a": {"cpu": _phase()}}, hostname="node-1")
    assert b'"hostname"' not in dumps_line(record)
    line = dumps_line(record, include_hostname=True)
    assert b',"node_rank":0,"hostname":"node-1","timestamp_unix_ns":' in line
    closing = ClosingLine(stream="step_time", written_records=0, dropped_batches=0)
    assert b"hostname" not in dumps_line(closing, include_hostname=True)


def test_warning_dumps_refuses_other_records_and_loads_is_strict() -> None:
    with pytest.raises(TypeError):
        dumps_warning_file(ClosingLine(stream="process", written_records=0, dropped_batches=0))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        dumps_line(object())  # type: ignore[arg-type]
    warning = FinalizationWarning(
        completed_at="2025-01-01T00:00:00+00:00",
        reason="export_incomplete",
        message="Export lost records.",
        export=ExportLoss(
            written_records=3, dropped_batches=1, failed_records=0, skipped_items=0,
            exporter_failed=False,
        ),
    )  # fmt: skip
    text = dumps_warning_file(warning)
    assert loads_warning_file(text) == warning
    with pytest.raises(RecordError) as info:
        loads_warning_file(text.replace(b'"failed_records": 0', b'"failed_records": -1'))
    assert info.value.pointer == "/export/failed_records"
    with pytest.raises(RecordError, match="invalid JSON"):
        loads_warning_file(b"{")
