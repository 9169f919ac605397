"""RecordBuilder: wire items → typed records of the selected streams, or counted skips."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builder_items import ITEM_MAKERS, MALFORMED
from tests.custom_exporters import (
    ALL_FILE_STREAMS,
    IDENTITY,
    IDENTITY_LOCAL0,
    OBSERVED_NS,
    batch,
    process_item,
    runtime_item,
    stdout_item,
    step_time_item,
    system_item,
)
from traceml_ai.export import ExportContext, ExportSummary, JsonlExporter, RecordBuilder
from traceml_ai.export._builder import MAX_STRING_BYTES
from traceml_records import (
    STREAMS_BY_NAME,
    PhaseTiming,
    ProcessRecord,
    RuntimeEnvironmentRecord,
    StdoutStderrRecord,
    StepMemoryRecord,
    StepTimeRecord,
    SystemGpuRecord,
    validate_paths,
)
from traceml_records._generated.records import DUMPERS, LOADERS

# Every test runs with the C encoder and with the pure-Python one (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("encoder", "builder_mode")


def round_trip(record: Any, include_hostname: bool) -> Any:
    """Record → line → record through the generated strict codecs."""
    line = orjson.dumps(DUMPERS[type(record)](record, include_hostname))
    assert b"NaN" not in line and b"Infinity" not in line
    return LOADERS[type(record)](orjson.loads(line), ())


def build_one(stream: str, item: Any, streams: tuple[str, ...] = ALL_FILE_STREAMS) -> Any:
    return RecordBuilder(streams, include_hostname=False).build(batch(stream, [item]))


# -- valid items ------------------------------------------------------------------------


@pytest.mark.parametrize("include_hostname", [False, True])
@pytest.mark.parametrize(
    ("stream", "record_class"),
    [
        ("step_time", StepTimeRecord),
        ("step_memory", StepMemoryRecord),
        ("process", ProcessRecord),
        ("runtime_environment", RuntimeEnvironmentRecord),
        ("stdout_stderr", StdoutStderrRecord),
    ],
)
def test_every_stream_item_becomes_a_valid_record(
    stream: str, record_class: type[Any], include_hostname: bool
) -> None:

    builder = RecordBuilder(ALL_FILE_STREAMS, include_hostname=include_hostname)
    items = [ITEM_MAKERS[stream](i) for i in range(5)]
    result = builder.build(batch(stream, items))
    assert result.skipped_items == 0
    assert list(result.records) == [stream]
    records = result.records[stream]
    assert [r.seq for r in records] == [0, 1, 2, 3, 4]
    for record in records:
        assert type(record) is record_class
        assert round_trip(record, include_hostname) == record
        assert record.observed_timestamp_unix_ns == OBSERVED_NS
        assert record.rank == IDENTITY["global_rank"]
        if stream != "stdout_stderr":
            assert record.global_rank == record.rank
            assert record.local_rank == IDENTITY["local_rank"]
            assert record.world_size == IDENTITY["world_size"]
            assert record.local_world_size == IDENTITY["local_world_size"]
            assert record.node_rank == IDENTITY["node_rank"]
            assert record.hostname == ("host-a" if include_hostname else None)
    if stream in ("process", "runtime_environment"):
        assert all(r.pid == IDENTITY["pid"] for r in records)


def test_step_time_events_are_typed_and_ints_become_floats() -> None:
    item = step_time_item(device="cuda:0")
    item["events"]["my_phase"]["cuda:0"] = {
        "cpu_ms": 3,
        "duration_ms": 4,
        "gpu_ms": 4,
        "is_gpu": True,
        "n_calls": 2,
    }
    (record,) = build_one("step_time", item).records["step_time"]
    timing = record.events["my_phase"]["cuda:0"]
    assert timing == PhaseTiming(cpu_ms=3.0, duration_ms=4.0, gpu_ms=4.0, is_gpu=True, n_calls=2)
    assert type(timing.cpu_ms) is float and type(timing.gpu_ms) is float
    line = orjson.dumps(DUMPERS[StepTimeRecord](record, False))
    assert b'"cpu_ms":3.0' in line


def test_system_item_gives_one_system_and_one_record_per_gpu() -> None:
    builder = RecordBuilder(("system", "system_gpu"), include_hostname=True)
    result = builder.build(
        batch("system", [system_item(seq=7, gpus=3), system_item(seq=8, gpus=0)])
    )
    assert result.skipped_items == 0
    assert list(result.records) == ["system", "system_gpu"]
    systems = result.records["system"]
    gpus = result.records["system_gpu"]
    assert [(s.seq, s.gpu_count, s.gpu_available) for s in systems] == [(7, 3, True), (8, 0, False)]
    assert [(g.seq, g.gpu_index) for g in gpus] == [(7, 0), (7, 1), (7, 2)]
    for record in [*systems, *gpus]:
        assert record.node_rank == 0 and record.local_rank == 0 and record.hostname == "host-a"
        assert round_trip(record, True) == record
    assert all(g.timestamp_unix_ns == systems[0].timestamp_unix_ns for g in gpus)
    assert type(gpus[0].temperature_c) is float  # sent as the int 61


def test_only_selected_file_streams_of_a_system_batch_are_built() -> None:
    b = batch("system", [system_item(gpus=2)])
    only_system = RecordBuilder(("system",), False).build(b)
    assert list(only_system.records) == ["system"]
    only_gpu = RecordBuilder(("system_gpu",), False).build(b)
    assert list(only_gpu.records) == ["system_gpu"] and len(only_gpu.records["system_gpu"]) == 2


class _Untouchable(list[Any]):
    """Items that fail the test if anything looks at them."""

    def __iter__(self) -> Any:
        raise AssertionError("items of an unselected stream were looked at")

    def __len__(self) -> int:
        raise AssertionError("items of an unselected stream were counted")


@pytest.mark.parametrize(
    "stream", ["step_memory", "process", "system", "runtime_environment", "stdout_stderr"]
)
def test_unselected_stream_is_never_built_nor_counted(stream: str) -> None:
    builder = RecordBuilder(("step_time",), include_hostname=False)
    b = batch(stream, [], nbytes=10)
    b.payload["items"] = _Untouchable()
    result = builder.build(b)
    assert result.records == {} and result.skipped_items == 0
    assert not builder.wants(b)
    # Malformed items of an unselected stream are not skipped items either.
    assert builder.build(batch(stream, [{"bad": 1}, 5, None])).skipped_items == 0


def test_unknown_stream_names_are_refused() -> None:
    with pytest.raises(ValueError, match="nope"):
        RecordBuilder(("step_time", "nope"), False)
    assert RecordBuilder(("system_gpu", "step_time"), False).streams == ("step_time", "system_gpu")


# -- malformed items: skipped and counted, never raising ------------------------------------


@pytest.mark.parametrize(
    ("stream", "item"),
    [pytest.param(stream, item, id=f"{stream}: {why}") for stream, why, item in MALFORMED],
)
def test_malformed_item_is_skipped_and_counted(stream: str, item: Any) -> None:
    builder = RecordBuilder(ALL_FILE_STREAMS, include_hostname=True)
    good_a, good_b = ITEM_MAKERS[stream](0), ITEM_MAKERS[stream](2)
    result = builder.build(batch(stream, [good_a, item, good_b]))
    assert result.skipped_items == 1
    first = "system" if stream == "system" else stream
    assert [r.seq for r in result.records[first]] == [0, 2]
    if stream == "system":
        # The whole snapshot goes, gpus included, so (node_rank, seq) keeps gpu_count lines.
        assert [g.seq for g in result.records["system_gpu"]] == [0, 0, 2, 2]


def test_stdout_line_may_be_empty_or_hold_carriage_return() -> None:
    builder = RecordBuilder(("stdout_stderr",), False)
    result = builder.build(batch("stdout_stderr", [stdout_item(line=""), stdout_item(line="a\rb")]))
    assert [r.line for r in result.records["stdout_stderr"]] == ["", "a\rb"]


def test_strings_at_the_size_limit_are_kept() -> None:
    item = stdout_item(line="x" * MAX_STRING_BYTES)
    assert len(build_one("stdout_stderr", item).records["stdout_stderr"]) == 1
    item = stdout_item(line="é" * (MAX_STRING_BYTES // 2))  # two bytes each: exactly the limit
    assert len(build_one("stdout_stderr", item).records["stdout_stderr"]) == 1


# -- non-finite numbers ------------------------------------------------------------------


def test_non_finite_in_nullable_fields_becomes_null() -> None:
    st_item = step_time_item()
    st_item["events"]["my_phase"]["cpu"]["gpu_ms"] = math.nan  # is_gpu false: gpu_ms is nullable
    sys_item = system_item(gpus=1)
    sys_item["gpus"][0].update(
        utilization_percent=math.nan,
        temperature_c=-math.inf,
        power_usage_w=math.inf,
        power_limit_w=math.nan,
    )
    builder = RecordBuilder(ALL_FILE_STREAMS, include_hostname=False)
    (st_record,) = builder.build(batch("step_time", [st_item])).records["step_time"]
    assert st_record.events["my_phase"]["cpu"].gpu_ms is None
    # The caller's payload is left as it was.
    assert math.isnan(st_item["events"]["my_phase"]["cpu"]["gpu_ms"])
    result = builder.build(batch("system", [sys_item]))
    (gpu,) = result.records["system_gpu"]
    assert (gpu.utilization_percent, gpu.temperature_c, gpu.power_usage_w, gpu.power_limit_w) == (
        None,
        None,
        None,
        None,
    )
    line = orjson.dumps(DUMPERS[SystemGpuRecord](gpu, False))
    assert b'"temperature_c":null' in line
    assert round_trip(st_record, False) == st_record


def test_non_finite_in_non_nullable_fields_skips_the_item() -> None:
    builder = RecordBuilder(ALL_FILE_STREAMS, include_hostname=False)
    bad = process_item()
    bad["cpu_percent"] = -math.inf
    result = builder.build(batch("process", [bad, process_item(seq=2)]))
    assert result.skipped_items == 1 and [r.seq for r in result.records["process"]] == [2]


# -- identity ------------------------------------------------------------------------------

BAD_IDENTITIES: list[tuple[str, Any]] = [
    ("not a dict", ["rank", 0]),
    ("missing global_rank", {k: v for k, v in IDENTITY.items() if k != "global_rank"}),
    ("global_rank string", {**IDENTITY, "global_rank": "1"}),
    ("global_rank bool", {**IDENTITY, "global_rank": True}),
    ("global_rank >= world_size", {**IDENTITY, "global_rank": 4}),
    ("local_rank >= local_world_size", {**IDENTITY, "local_rank": 2}),
    ("local_world_size > world_size", {**IDENTITY, "local_world_size": 5}),
    ("world_size 0", {**IDENTITY, "world_size": 0, "global_rank": 0}),
    ("negative node_rank", {**IDENTITY, "node_rank": -1}),
    ("float local_rank", {**IDENTITY, "local_rank": 1.0}),
]


@pytest.mark.parametrize("identity", [pytest.param(ident, id=why) for why, ident in BAD_IDENTITIES])
@pytest.mark.parametrize("stream", list(ITEM_MAKERS))
def test_bad_identity_skips_every_item(stream: str, identity: Any) -> None:
    builder = RecordBuilder(ALL_FILE_STREAMS, include_hostname=True)
    items = [ITEM_MAKERS[stream](i) for i in range(3)]
    result = builder.build(batch(stream, items, identity=identity))
    assert result.records == {} and result.skipped_items == 3


@pytest.mark.parametrize("observed", [-1, 1.5, None, True])
def test_bad_observed_timestamp_skips_every_item(observed: Any) -> None:
    result = RecordBuilder(("step_time",), False).build(
        batch("step_time", [step_time_item(), step_time_item(seq=1)], observed=observed)
    )
    assert result.records == {} and result.skipped_items == 2


@pytest.mark.parametrize("pid", [None, 0, "12", 1.0])
def test_bad_pid_skips_process_and_runtime_batches_only(pid: Any) -> None:
    ident = {**IDENTITY, "pid": pid}
    builder = RecordBuilder(ALL_FILE_STREAMS, False)
    assert builder.build(batch("process", [process_item()], identity=ident)).skipped_items == 1
    assert (
        builder.build(batch("runtime_environment", [runtime_item()], identity=ident)).records == {}
    )
    ok = builder.build(batch("step_time", [step_time_item()], identity=ident))
    assert len(ok.records["step_time"]) == 1 and ok.skipped_items == 0


def test_system_only_from_local_rank_zero() -> None:
    builder = RecordBuilder(ALL_FILE_STREAMS, False)
    result = builder.build(batch("system", [system_item(), system_item(seq=1)], identity=IDENTITY))
    assert result.records == {} and result.skipped_items == 2
    ok = builder.build(batch("system", [system_item()], identity=IDENTITY_LOCAL0))
    assert ok.skipped_items == 0 and len(ok.records["system"]) == 1


@pytest.mark.parametrize("hostname", [None, 5, ["h"], "x" * (MAX_STRING_BYTES + 1)])
def test_unusable_hostname_becomes_null(hostname: Any) -> None:
    result = RecordBuilder(("step_time",), True).build(
        batch("step_time", [step_time_item()], identity={**IDENTITY, "hostname": hostname})
    )
    (record,) = result.records["step_time"]
    assert record.hostname is None
    assert b'"hostname":null' in orjson.dumps(DUMPERS[StepTimeRecord](record, True))


def test_stdout_stderr_has_no_hostname_and_global_rank() -> None:
    result = RecordBuilder(("stdout_stderr",), True).build(batch("stdout_stderr", [stdout_item()]))
    (record,) = result.records["stdout_stderr"]
    assert record.rank == 1 and not hasattr(record, "hostname")


def test_items_not_a_list_counts_one_lost_item() -> None:
    b = batch("step_time", [])
    b.payload["items"] = {"0": step_time_item()}
    assert RecordBuilder(("step_time",), False).build(b).skipped_items == 1


# -- property: never raises, every item accounted for -------------------------------------

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**64), max_value=2**64)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def _perturbed_item(stream: str) -> st.SearchStrategy[Any]:
    """A valid item with one field replaced by arbitrary JSON (or the item replaced)."""

    def perturb(seed: tuple[int, str, Any]) -> Any:
        index, mode, value = seed
        item = ITEM_MAKERS[stream](index)
        keys = sorted(item)
        key = keys[index % len(keys)]
        if mode == "replace":
            item[key] = value
        elif mode == "drop":
            del item[key]
        elif mode == "whole":
            return value
        return item

    return st.tuples(
        st.integers(0, 50), st.sampled_from(["replace", "drop", "whole", "keep"]), _json
    ).map(perturb)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_build_never_raises_and_accounts_for_every_item(data: st.DataObject) -> None:
    stream = data.draw(st.sampled_from(sorted(ITEM_MAKERS)))
    items = data.draw(st.lists(_perturbed_item(stream), max_size=6))
    identity = data.draw(
        st.sampled_from([IDENTITY, IDENTITY_LOCAL0]) | st.dictionaries(st.text(max_size=4), _json)
    )
    builder = RecordBuilder(ALL_FILE_STREAMS, include_hostname=data.draw(st.booleans()))
    result = builder.build(batch(stream, items, identity=identity, nbytes=1))
    main = "system" if stream == "system" else stream
    assert len(result.records.get(main, [])) + result.skipped_items == len(items)
    for name, records in result.records.items():
        spec = STREAMS_BY_NAME[name]
        for record in records:
            assert type(record) is spec.record_class
            assert round_trip(record, True) == record


# -- what the builder lets through, the validator accepts ------------------------------------


def test_built_records_pass_the_validator(tmp_path: Path) -> None:
    """Valid and malformed items of every stream → JSONL files that ``traceml validate`` passes."""
    context = ExportContext(
        run_dir=tmp_path,
        export_dir=tmp_path / "aggregator" / "export",
        streams=ALL_FILE_STREAMS,
        include_hostname=True,
    )
    exporter = JsonlExporter.create(context)
    builder = RecordBuilder(ALL_FILE_STREAMS, include_hostname=True)
    malformed_by_stream: dict[str, list[Any]] = {}
    for stream, _why, item in MALFORMED:
        malformed_by_stream.setdefault(stream, []).append(item)
    skipped = 0
    written = 0
    for stream, maker in ITEM_MAKERS.items():
        bad = malformed_by_stream.get(stream, [])
        items: list[Any] = []
        for i, item in enumerate(bad):
            items += [maker(i), item]
        items.append(maker(len(bad)))
        result = builder.build(batch(stream, items))
        skipped += result.skipped_items
        for records in result.records.values():
            exporter.export(records)
            written += len(records)
    exporter.close(ExportSummary(written_records={}, dropped_batches=0))
    report = validate_paths([context.export_dir])
    assert report.problems == (), "\n".join(str(p) for p in report.problems)
    assert skipped == len(MALFORMED)
    assert sum(s.data_lines for s in report.files) == written


def test_the_suite_runs_in_the_mode_it_says(encoder: str, builder_mode: str) -> None:
    from traceml_ai.export._encoded import EncodedLines

    built = RecordBuilder(["step_time"], False).build(batch("step_time", [step_time_item()]))
    group = built.records["step_time"]
    assert isinstance(group, EncodedLines) == (encoder == "c" and builder_mode == "lines")
    assert [r.step for r in group] == [1]
