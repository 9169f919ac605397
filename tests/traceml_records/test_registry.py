"""The stream registry, and parsing of the ``export_streams`` setting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from traceml_records import (
    DEFAULT_EXPORT_STREAMS,
    SELECTION_NAMES,
    STREAMS,
    STREAMS_BY_NAME,
    parse_export_streams,
    stream_spec,
    streams_selected_by,
)
from traceml_records._schemas import schema_documents

ALL = (
    "step_time",
    "step_memory",
    "process",
    "system",
    "system_gpu",
    "runtime_environment",
    "stdout_stderr",
    "collectives",
)
SUPPORTED = "step_time, step_memory, process, system, collectives, all"


def test_registry_lists_every_stream_in_file_order() -> None:
    assert tuple(spec.name for spec in STREAMS) == ALL
    assert SELECTION_NAMES == (
        "step_time",
        "step_memory",
        "process",
        "system",
        "collectives",
        "all",
    )
    for spec in STREAMS:
        assert spec.file_name == f"{spec.name}.jsonl"
        assert STREAMS_BY_NAME[spec.name] is spec is stream_spec(spec.name)
        assert spec.carries_hostname is (spec.name != "stdout_stderr")
        schema = schema_documents()[spec.schema_file]
        assert schema["$id"] == spec.schema_id
        assert tuple(schema["x-traceml-key"]) == spec.key_fields
        assert all(field in schema["properties"] for field in spec.key_fields)
        assert spec.record_class.__name__ == schema["x-traceml-class"]


def test_keys_match_the_spec() -> None:
    keys = {spec.name: spec.key_fields for spec in STREAMS}
    assert keys == {
        "step_time": ("global_rank", "step"),
        "step_memory": ("global_rank", "device", "step"),
        "process": ("global_rank", "seq"),
        "system": ("node_rank", "seq"),
        "system_gpu": ("node_rank", "seq", "gpu_index"),
        "runtime_environment": ("global_rank",),
        "stdout_stderr": ("rank", "seq"),
        "collectives": ("global_rank", "step", "phase", "op", "group", "peer_rank"),
    }


def test_selection_names() -> None:
    assert streams_selected_by("system") == ("system", "system_gpu")
    assert streams_selected_by("all") == ALL
    assert streams_selected_by("step_time") == ("step_time",)
    with pytest.raises(ValueError, match="unknown stream 'system_gpu'"):
        streams_selected_by("system_gpu")
    with pytest.raises(KeyError):
        stream_spec("all")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("step_time", ("step_time",)),
        (DEFAULT_EXPORT_STREAMS, ("step_time",)),
        ("  step_time ,  step_memory  ", ("step_time", "step_memory")),
        ("step_memory,step_time", ("step_time", "step_memory")),
        ("step_time,step_time,step_time", ("step_time",)),
        ("system", ("system", "system_gpu")),
        ("process,system,step_time", ("step_time", "process", "system", "system_gpu")),
        ("all", ALL),
        ("all,step_time,system", ALL),
        ("\tstep_memory\n", ("step_memory",)),
    ],
)
def test_parse_spaces_repeats_order_all_system(text: str, expected: tuple[str, ...]) -> None:
    assert parse_export_streams(text) == expected


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("bogus", "'bogus'"),
        ("step_time,bogus", "'bogus'"),
        ("Step_Time", "'Step_Time'"),
        ("system_gpu", "'system_gpu'"),
        ("runtime_environment", "'runtime_environment'"),
        ("step_time;process", "'step_time;process'"),
    ],
)
def test_unknown_names_are_named_with_the_supported_list(text: str, named: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_export_streams(text)
    message = str(info.value)
    assert named in message
    assert message.endswith(f"supported: {SUPPORTED}")


@pytest.mark.parametrize(
    "text", ["", "   ", "step_time,,process", "step_time, ,process", ",", "step_time,"]
)
def test_empty_value_or_empty_item_is_refused(text: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_export_streams(text)
    message = str(info.value)
    assert "empty" in message
    assert message.endswith(f"supported: {SUPPORTED}")


def test_a_non_string_is_refused() -> None:
    with pytest.raises(ValueError, match="expected a comma-separated string"):
        parse_export_streams(["step_time"])  # type: ignore[arg-type]


@given(
    st.lists(st.sampled_from(SELECTION_NAMES), min_size=1, max_size=8),
    st.lists(st.sampled_from(["", " ", "\t"]), min_size=16, max_size=16),
)
def test_order_spaces_and_repeats_never_change_the_result(
    names: list[str], pads: list[str]
) -> None:
    text = ",".join(f"{pads[i % 16]}{n}{pads[(i + 7) % 16]}" for i, n in enumerate(names))
    expected = {s for n in names for s in streams_selected_by(n)}
    result = parse_export_streams(text)
    assert set(result) == expected
    assert list(result) == [s for s in ALL if s in expected]
    assert parse_export_streams(",".join(reversed(names))) == result
