"""Writer, reader, validator and builder agree on every single-line rule.

A differential test: valid lines of every stream, and every kind of mutation the
schemas and the named rules of ``traceml_records._rules`` describe (a field of the
wrong type, out of range, null where it may not be, outside its set; a schema
condition broken on either branch; a required event removed, a reserved name added;
each named line rule broken). For each line:

    builder skips the item  ⇔  ``traceml validate`` flags the line  ⇔  strict
    ``loads_line`` raises  ⇔  ``dumps_line`` refuses the record (when the schema
    alone lets a record be built)

The builder side is left out only where a line cannot come from a wire item: a
``rank`` other than ``global_rank`` (the aggregator writes both from one value), the
hostname (decoration: a malformed one is dropped, not the item), ``schema_version``
(the aggregator writes it) and system lines
whose gpu_count is beyond a test-sized list of GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.strategies import as_dumped, consistent_json, warning_json
from traceml_ai.export._builder import RecordBuilder
from traceml_ai.export._finalize import _check_warning
from traceml_ai.transport.wire import ReceivedBatch
from traceml_records import (
    FinalizationWarning,
    RecordError,
    dumps_line,
    loads_line,
    loads_warning_file,
    validate_line,
)
from traceml_records._codec import SPEEDUPS, line_problems
from traceml_records._generated.records import IDENTITY_FIELDS, LOADERS, is_checked
from traceml_records._generated.registry import STREAMS
from traceml_records._rules import RULES, duration_ok, identity_ok, line_checks, topology_of
from traceml_records._schemas import schema_documents

SPECS = {spec.name: spec for spec in STREAMS}
DOCS = schema_documents()
INT64_MAX = 2**63 - 1

# ------------------------------------------------------------------ mutations
# (name, function of a valid line dict → a mutated copy, or None when it does not apply)


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        uri, _, fragment = node["$ref"].partition("#")
        doc = next(d for d in DOCS.values() if d["$id"] == uri)
        node = doc
        for part in fragment.strip("/").split("/"):
            node = node[part]
    return node


def _types(node: dict[str, Any]) -> list[str]:
    kind = node.get("type")
    return kind if isinstance(kind, list) else [kind]


def _wrong_values(node: dict[str, Any]) -> Iterator[tuple[str, Any]]:
    """Values the field schema ``node`` refuses, each with a label."""
    kinds = _types(node)
    if "null" not in kinds:
        yield "null", None
    if "string" not in kinds:
        yield "string", "x"
    if "boolean" not in kinds:
        yield "bool", True
    if "integer" in kinds:
        yield "fraction", 1.5
        yield "beyond_int64", INT64_MAX + 1
    if "number" not in kinds and "integer" not in kinds:
        yield "number", 1
    if "minimum" in node:
        yield "below_minimum", node["minimum"] - 1
    if "maximum" in node and node["maximum"] < INT64_MAX:
        yield "above_maximum", node["maximum"] + 1
    if "enum" in node:
        yield "outside_enum", "no-such-value"
    if "const" in node:
        yield "not_const", "other" if isinstance(node["const"], str) else 2
    if "pattern" in node:
        yield "pattern", "Not A Match!"


def _field_mutations(stream: str) -> Iterator[tuple[str, Any]]:
    props = DOCS[SPECS[stream].schema_file]["properties"]
    required = DOCS[SPECS[stream].schema_file]["required"]
    for name, prop in props.items():
        if name in ("stream", "events"):
            continue
        node = _resolve(prop)
        for label, value in _wrong_values(node):
            if label == "null" and name not in required:
                # An optional key (gpu_uuid) is absent when unknown: validate and
                # strict loads refuse its null, but its record is the line without
                # the key, which dumps_line writes
                # (tests/traceml_ai/rank/test_gpu_realworld.py).
                continue

            def mutate(d: dict[str, Any], name: str = name, value: Any = value) -> Any:
                return {**d, name: value} if name in d else None

            yield f"{name}:{label}", mutate


def _violating(test: dict[str, Any], current: Any) -> Any:
    """A value of the field's own type that breaks a condition test."""
    if "const" in test:
        const = test["const"]
        if isinstance(const, bool):
            return not const
        if isinstance(const, str):
            return "mps" if const == "cpu" else "cpu"
        return const + 1
    if test["type"] == "null":
        return "gloo" if isinstance(current, str) or current is None else 1
    return None


def _holding(test: dict[str, Any], current: Any) -> Any:
    return test["const"]


def _conditions(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    if "if" in schema or "then" in schema:
        yield schema
    yield from schema.get("allOf", [])


def _condition_mutations(stream: str) -> Iterator[tuple[str, Any]]:
    schema = DOCS[SPECS[stream].schema_file]
    for index, cond in enumerate(_conditions(schema)):
        when = cond.get("if", {}).get("properties", {})
        for branch in ("then", "else") if "if" in cond else ("plain",):
            tests = (cond if branch == "plain" else cond.get(branch, {})).get("properties", {})
            for field, test in tests.items():

                def mutate(
                    d: dict[str, Any],
                    when: dict[str, Any] = when,
                    branch: str = branch,
                    field: str = field,
                    test: dict[str, Any] = test,
                ) -> Any:
                    out = dict(d)
                    for name, w in when.items():
                        out[name] = _holding(w, out[name])
                        if branch == "else":
                            out[name] = _violating(w, out[name])
                    out[field] = _violating(test, out[field])
                    if field == "distributed_backend" and out[field] == 1:
                        out[field] = "gloo"
                    return out

                yield f"condition{index}:{branch}:{field}", mutate


def _phase_mutations() -> Iterator[tuple[str, Any]]:
    def each_phase(d: dict[str, Any], change: dict[str, Any]) -> dict[str, Any]:
        events = {
            name: {dev: {**t, **change} for dev, t in devices.items()}
            for name, devices in d["events"].items()
        }
        return {**d, "events": events}

    node = _resolve(DOCS["common.schema.json"]["$defs"]["phase_timing"])
    for name, prop in node["properties"].items():
        for label, value in _wrong_values(prop):
            yield (
                f"phase.{name}:{label}",
                (lambda d, name=name, value=value: each_phase(d, {name: value})),
            )
    yield "phase:is_gpu_without_gpu_ms", lambda d: each_phase(d, {"is_gpu": True, "gpu_ms": None})
    yield (
        "phase:missing_key",
        lambda d: {
            **d,
            "events": {
                n: {dev: {k: v for k, v in t.items() if k != "n_calls"} for dev, t in devs.items()}
                for n, devs in d["events"].items()
            },
        },
    )


def _events_mutations() -> Iterator[tuple[str, Any]]:
    step = "_traceml_internal:step_time"

    def without_step(d: dict[str, Any]) -> Any:
        events = {k: v for k, v in d["events"].items() if k != step}
        return {**d, "events": events} if events else {**d, "events": {}}

    def reserved(d: dict[str, Any]) -> dict[str, Any]:
        events = dict(d["events"])
        events["_traceml_internal:mine"] = events[step]
        return {**d, "events": dict(sorted(events.items()))}

    def bad_device(d: dict[str, Any]) -> dict[str, Any]:
        events = dict(d["events"])
        events[step] = {"GPU0": next(iter(events[step].values()))}
        return {**d, "events": events}

    def empty_devices(d: dict[str, Any]) -> dict[str, Any]:
        return {**d, "events": {**d["events"], step: {}}}

    def empty_name(d: dict[str, Any]) -> dict[str, Any]:
        events = {"": d["events"][step], **d["events"]}
        return {**d, "events": events}

    yield "events:without_step_event", without_step
    yield "events:reserved_name", reserved
    yield "events:bad_device_key", bad_device
    yield "events:empty_device_map", empty_devices
    yield "events:empty_name", empty_name


def _break_duration(d: dict[str, Any]) -> dict[str, Any]:
    events = {
        name: {dev: {**t, "duration_ms": t["duration_ms"] + 1.0} for dev, t in devs.items()}
        for name, devs in d["events"].items()
    }
    return {**d, "events": events}


# One mutation per named line rule (the test below checks every rule has one).
RULE_MUTATIONS: dict[str, Any] = {
    "rank-equals-global-rank": lambda d: {**d, "rank": d["global_rank"] + 1},
    "global-rank-below-world-size": lambda d: {
        **d,
        "rank": d["world_size"],
        "global_rank": d["world_size"],
    },
    "local-rank-below-local-world-size": lambda d: {**d, "local_rank": d["local_world_size"]},
    "local-world-size-within-world-size": lambda d: (
        {**d, "local_world_size": d["world_size"] + 1} if d["world_size"] < INT64_MAX else None
    ),
    "duration-matches-timing": _break_duration,
    "topology-from-world-sizes": lambda d: {
        **d,
        "topology": "multi_node" if d["topology"] != "multi_node" else "single_process",
    },
    "python-version-format": lambda d: {**d, "python_version": "CPython 3"},
    "line-without-newline": lambda d: {**d, "line": d["line"] + "\n"},
    "parallel-rank-below-size": lambda d: _with_parallel(
        d, {"dp": {"rank": 2, "size": 2}}, "declared"
    ),
    "parallel-source-with-parallel": lambda d: _with_parallel(
        d, {"tp": {"rank": 0, "size": 1}}, None
    ),
}


def _with_parallel(d: dict[str, Any], parallel: Any, source: Any) -> dict[str, Any]:
    """``d`` (a runtime_environment line) with these ``parallel`` and ``parallel_source``."""
    rest = {k: v for k, v in d.items() if k not in ("parallel", "parallel_source")}
    return {**rest, "parallel": parallel, "parallel_source": source}


def mutations(stream: str) -> list[tuple[str, Any]]:
    out = [("valid", lambda d: d)]
    out += list(_field_mutations(stream))
    out += list(_condition_mutations(stream))
    if stream == "step_time":
        out += list(_phase_mutations()) + list(_events_mutations())
    out += [
        (f"rule:{name}", RULE_MUTATIONS[name])
        for name in SPECS[stream].rules
        if name in RULE_MUTATIONS
    ]
    return out


# ------------------------------------------------------------------ the builder side


def _gpu_items(count: int) -> list[dict[str, Any]]:
    return [
        {
            "gpu_index": i,
            "utilization_percent": None,
            "memory_used_bytes": None,
            "memory_total_bytes": None,
            "temperature_c": None,
            "power_usage_w": None,
            "power_limit_w": None,
            "gpu_uuid": None,
        }
        for i in range(count)
    ]


def wire_batch(stream: str, d: dict[str, Any]) -> ReceivedBatch | None:
    """The wire batch whose one item the builder should turn into line ``d`` (None
    when no wire item can give that line)."""
    if type(d.get("schema_version")) is not int or d["schema_version"] != 1:
        return None  # the aggregator writes it, not the rank
    if stream == "stdout_stderr":
        rank = d.get("rank")
        identity = {
            "global_rank": rank,
            "local_rank": 0,
            "world_size": rank + 1 if type(rank) is int and rank < INT64_MAX else 1,
            "local_world_size": 1,
            "node_rank": 0,
        }
    else:
        if (
            "rank" in d
            and "global_rank" in d
            and (type(d["rank"]) is not type(d["global_rank"]) or d["rank"] != d["global_rank"])
        ):
            return None  # the aggregator writes both from one value (True == 1 in Python)
        identity = {k: d.get(k) for k in ("global_rank", "local_rank", "world_size")}
        identity.update(local_world_size=d.get("local_world_size"), node_rank=d.get("node_rank"))
        identity["pid"] = d.get("pid", 1)
    item = {
        k: v for k, v in d.items() if k not in IDENTITY_FIELDS and k != "observed_timestamp_unix_ns"
    }
    if stream == "stdout_stderr":
        item = {k: v for k, v in item.items() if k != "rank"}
    # An optional field a line may lack (written before it existed) is null in an item.
    schema = DOCS[SPECS[stream].schema_file]
    for key in schema["properties"]:
        if key not in schema["required"] and key not in IDENTITY_FIELDS and key not in item:
            item[key] = None
    wire_stream = stream
    if stream == "system":
        count = item.pop("gpu_count")
        if type(count) is not int or not 0 <= count <= 8:
            return None
        item["gpus"] = _gpu_items(count)
    elif stream == "system_gpu":
        wire_stream = "system"
        gpu = {k: v for k, v in item.items() if k not in ("timestamp_unix_ns", "seq")}
        item = {
            "timestamp_unix_ns": item.get("timestamp_unix_ns"),
            "seq": item.get("seq"),
            "cpu_percent": 1.0,
            "ram_used_bytes": 1,
            "ram_total_bytes": 2,
            "gpu_available": True,
            "gpus": [gpu],
        }
    payload = {"stream": wire_stream, "identity": identity, "items": [item]}
    return ReceivedBatch(d.get("observed_timestamp_unix_ns"), payload, 0)  # type: ignore[arg-type]


def built_line(stream: str, batch: ReceivedBatch, encode_lines: bool) -> bytes | None:
    """The line the builder makes of the batch's item, or None when it skips it."""
    builder = RecordBuilder([stream], include_hostname=False, encode_lines=encode_lines)
    result = builder.build(batch)
    group = result.records.get(stream)
    if not group:
        assert result.skipped_items == 1 or stream == "system_gpu"
        return None
    if hasattr(group, "data"):  # EncodedLines
        return bytes(group.data)  # type: ignore[union-attr]
    (record,) = group
    assert is_checked(record)
    return dumps_line(record)


# ------------------------------------------------------------------ the property

STREAMS_UNDER_TEST = [spec.name for spec in STREAMS]


@st.composite
def mutated_line(draw: st.DrawFn, stream: str) -> tuple[str, dict[str, Any]]:
    d = draw(consistent_json(stream))
    d.pop("hostname", None)  # decoration; see the module docstring
    name, mutate = draw(st.sampled_from(mutations(stream)))
    out = mutate(d)
    return name, (d if out is None else out)


def _strict_raises(line: bytes) -> RecordError | None:
    try:
        loads_line(line)
    except RecordError as exc:
        return exc
    return None


@pytest.mark.parametrize("stream", STREAMS_UNDER_TEST)
@given(data=st.data())
def test_builder_validate_loads_and_dumps_agree(stream: str, data: st.DataObject) -> None:
    name, d = data.draw(mutated_line(stream), label="mutation")
    try:
        line = orjson.dumps(d) + b"\n"
    except orjson.JSONEncodeError:
        return  # beyond 64-bit integers: no line at all
    flagged = validate_line(line)
    error = _strict_raises(line)
    assert bool(flagged) == (error is not None), (name, [str(p) for p in flagged], error)
    if error is not None:
        assert error.pointer in {p.pointer for p in flagged}, (name, error, flagged)

    # dumps_line refuses a record whose line strict loads_line refuses.
    try:
        lenient = loads_line(line, strict=False)
    except RecordError:
        lenient = None  # the schema refuses it: no record can be built
    # What dumps_line and the builder write for it: the line, with any always-written
    # key it lacks (a line written before that key existed) as null.
    written = orjson.dumps(as_dumped(stream, d)) + b"\n" if error is None else line
    if lenient is not None:
        if error is None:
            assert dumps_line(lenient) == written
            fresh = attrs.evolve(lenient)  # as a user would build it: unmarked
            assert not is_checked(fresh)
            assert dumps_line(fresh) == written
        else:
            with pytest.raises(RecordError) as refused:
                dumps_line(lenient)
            assert refused.value.pointer == error.pointer
            with pytest.raises(RecordError):
                dumps_line(attrs.evolve(lenient))

    batch = wire_batch(stream, d)
    if batch is None:
        return
    modes = (False, True) if stream == "step_time" and SPEEDUPS else (False,)
    for encode_lines in modes:
        built = built_line(stream, batch, encode_lines)
        assert (built is None) == (error is not None), (name, encode_lines, error, built)
        if built is not None and stream != "system_gpu":
            assert built == written, name


# ------------------------------------------------------------------ the rules module


def test_every_named_rule_is_listed_by_a_schema_and_every_line_rule_is_broken() -> None:
    warning_rules = set(DOCS["finalization_warning.schema.json"]["x-traceml-rules"])
    listed = {name for spec in STREAMS for name in spec.rules}
    assert listed | warning_rules <= set(RULES)
    for name, rule in RULES.items():
        assert name in listed | warning_rules, f"rule {name} is on no schema"
        if rule.check is not None and name not in warning_rules:
            assert name in RULE_MUTATIONS, f"no mutation breaks {name}"


def test_every_stream_lists_the_identity_rules_it_carries() -> None:
    for spec in STREAMS:
        carries = "global_rank" in DOCS[spec.schema_file]["properties"]
        assert ("rank-equals-global-rank" in spec.rules) == carries, spec.name


def test_predicates() -> None:
    assert identity_ok(1, 1, 0, 2, 1)
    assert not identity_ok(1, 0, 0, 2, 1)
    assert not identity_ok(2, 2, 0, 2, 1)
    assert not identity_ok(0, 0, 1, 2, 1)
    assert not identity_ok(0, 0, 0, 2, 3)
    assert duration_ok(True, 1.0, 2.0, 2.0) and not duration_ok(True, 2.0, 2.0, None)
    assert duration_ok(False, 1.0, 1.0, 5.0) and not duration_ok(False, 1.0, 5.0, 5.0)
    assert (topology_of(1, 1), topology_of(4, 4), topology_of(8, 4)) == (
        "single_process",
        "single_node_multi_process",
        "multi_node",
    )
    assert not line_checks(("closing-line-last", "unique-key"))


def test_the_issue_drifts_are_gone() -> None:
    """The three drifts of issue 11, each on one line."""
    step = (
        b'{"stream":"step_time","schema_version":1,"observed_timestamp_unix_ns":1,"rank":0,'
        b'"global_rank":0,"local_rank":0,"world_size":1,"local_world_size":1,"node_rank":0,'
        b'"timestamp_unix_ns":1,"seq":0,"step":1,"events":{"a":{"cpu":{"cpu_ms":1.0,'
        b'"duration_ms":1.0,"gpu_ms":null,"is_gpu":false,"n_calls":1}}}}\n'
    )
    # validate accepted a step_time line without _traceml_internal:step_time.
    assert [p.pointer for p in validate_line(step)] == ["/events/_traceml_internal:step_time"]
    good = step.replace(b'"a":', b'"_traceml_internal:step_time":')
    assert validate_line(good) == []
    # loads_line accepted duration_ms != cpu_ms with is_gpu false, and rank >= world_size.
    for bad, pointer in (
        (good.replace(b'"duration_ms":1.0', b'"duration_ms":2.0'), "duration_ms"),
        (good.replace(b'"rank":0,"global_rank":0', b'"rank":1,"global_rank":1'), "/global_rank"),
    ):
        assert validate_line(bad)
        with pytest.raises(RecordError) as info:
            loads_line(bad)
        assert info.value.pointer.endswith(pointer)
        assert line_problems(orjson.loads(bad))
    # dumps_line wrote records loads_line refuses.
    record = loads_line(good)
    for changes in ({"global_rank": 5, "rank": 5}, {"rank": 3}):
        with pytest.raises(RecordError):
            dumps_line(attrs.evolve(record, **changes))


def test_a_user_built_record_is_checked_once_then_written_fast() -> None:
    record = loads_line(
        b'{"stream":"stdout_stderr","schema_version":1,"observed_timestamp_unix_ns":1,'
        b'"rank":0,"timestamp_unix_ns":1,"seq":0,"source":"stdout","line":"x"}'
    )
    assert is_checked(record)
    copy = attrs.evolve(record)
    assert not is_checked(copy)
    assert dumps_line(copy) == dumps_line(record)
    assert is_checked(copy)
    bad = attrs.evolve(record, line="a\nb")
    with pytest.raises(RecordError) as info:
        dumps_line(bad)
    assert info.value.pointer == "/line"
    assert not is_checked(bad)


def test_lenient_loads_keeps_a_rule_breaking_record_unchecked() -> None:
    line = (
        b'{"stream":"stdout_stderr","schema_version":1,"observed_timestamp_unix_ns":1,'
        b'"rank":0,"timestamp_unix_ns":1,"seq":0,"source":"stdout","line":"a\\nb"}'
    )
    with pytest.raises(RecordError):
        loads_line(line)
    record = loads_line(line, strict=False)
    assert not is_checked(record)
    with pytest.raises(RecordError):
        dumps_line(record)


def test_nan_in_a_nullable_float_is_still_written_as_null_for_a_user_record() -> None:
    record = loads_line(
        b'{"stream":"system_gpu","schema_version":1,"observed_timestamp_unix_ns":1,"rank":0,'
        b'"global_rank":0,"local_rank":0,"world_size":1,"local_world_size":1,"node_rank":0,'
        b'"timestamp_unix_ns":1,"seq":0,"gpu_index":0,"utilization_percent":null,'
        b'"memory_used_bytes":null,"memory_total_bytes":null,"temperature_c":null,'
        b'"power_usage_w":null,"power_limit_w":null}'
    )
    hot = attrs.evolve(record, temperature_c=math.nan)
    assert b'"temperature_c":null' in dumps_line(hot)


# ------------------------------------------------------------------ finalization_warning.json

WARNING_MUTATIONS: dict[str, Any] = {
    "valid": lambda d: d,
    "warning-ranks-sorted": lambda d: (
        {**d, "missing_ranks": d["missing_ranks"][::-1]}
        if len(d.get("missing_ranks", ())) > 1
        else None
    ),
    "warning-ranks-below-world-size": lambda d: (
        {**d, "missing_ranks": [*d["missing_ranks"], d["expected_world_size"]]}
        if "missing_ranks" in d
        else None
    ),
    "warning-ranks-disjoint": lambda d: (
        {**d, "finished_ranks": sorted({*d["finished_ranks"], d["missing_ranks"][0]})}
        if "missing_ranks" in d
        else None
    ),
    "warning-export-shows-loss": lambda d: (
        {
            **d,
            "export": {
                **d["export"],
                "dropped_batches": 0,
                "failed_records": 0,
                "skipped_items": 0,
                "exporter_failed": False,
            },
        }
        if "export" in d
        else None
    ),
    "warning-completed-at-utc": lambda d: {**d, "completed_at": "2026-01-01T00:00:00Z"},
    "warning-message-not-blank": lambda d: {**d, "message": " \t"},
}


def test_every_warning_rule_has_a_mutation() -> None:
    rules = DOCS["finalization_warning.schema.json"]["x-traceml-rules"]
    assert set(rules) == set(WARNING_MUTATIONS) - {"valid"}


@given(
    d=warning_json(),
    name=st.sampled_from(sorted(WARNING_MUTATIONS)),
)
def test_validate_loads_and_finalize_agree_on_the_warning(d: dict[str, Any], name: str) -> None:
    mutated = WARNING_MUTATIONS[name](d)
    if mutated is None:
        return
    data = orjson.dumps(mutated, option=orjson.OPT_INDENT_2) + b"\n"
    flagged = validate_line(data)
    try:
        warning = loads_warning_file(data)
        refused = None
    except RecordError as exc:
        refused = exc
        warning = None
    assert bool(flagged) == (refused is not None), (name, flagged, refused)
    if name != "valid":
        assert refused is not None and refused.pointer in {p.pointer for p in flagged}
    # finalize checks a warning before writing it with the same rules.
    record = LOADERS[FinalizationWarning](mutated, ())
    if warning is None:
        with pytest.raises(ValueError):
            _check_warning(record)
    else:
        _check_warning(record)
