"""Hypothesis strategies derived from the shipped JSON Schemas.

``json_for(schema_file)`` reads a schema and draws JSON objects that satisfy it:
types, bounds (integers within signed 64-bit), nullability, enums, consts,
patterns (device keys, drawn without a trailing newline: JSON Schema patterns are
ECMA, where ``$`` only matches at the very end), minimum lengths and sizes, optional
keys (``hostname``), finite floats, and arbitrary Unicode except surrogates (JSON in
UTF-8 cannot carry them). User event names never start with ``_traceml_internal:``.

``consistent(stream, obj)`` then bends a schema-valid object so that it also meets
the cross-field rules the validator enforces; ``records(cls)`` gives typed records
built from consistent objects.
"""

from __future__ import annotations

import datetime
from typing import Any

from hypothesis import strategies as st

from traceml_records import (
    STREAMS,
    ClosingLine,
    FinalizationWarning,
    RecordError,
)
from traceml_records._codec import BUILTIN_EVENTS, RESERVED_EVENT_PREFIX, STEP_TIME_EVENT
from traceml_records._generated.records import ENCODER_PLANS, LOADERS, Flag
from traceml_records._schemas import (
    CLOSING_SCHEMA_FILE,
    WARNING_SCHEMA_FILE,
    schema_documents,
)
from traceml_records.events import COLLECTIVE_PHASES

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1

TEXT = st.text(st.characters(exclude_categories=("Cs",)))
"""Any string JSON can carry."""

USER_EVENT_NAMES = st.text(st.characters(exclude_categories=("Cs",)), min_size=1).filter(
    lambda s: not s.startswith(RESERVED_EVENT_PREFIX)
)
EVENT_NAMES = st.one_of(st.sampled_from(sorted(BUILTIN_EVENTS)), USER_EVENT_NAMES)
STREAM_FILES = {spec.name: spec.schema_file for spec in STREAMS}
CLASSES = {spec.name: spec.record_class for spec in STREAMS}


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    uri, _, fragment = ref.partition("#")
    target: Any = next(d for d in schema_documents().values() if d["$id"] == uri)
    for part in fragment.strip("/").split("/"):
        if part:
            target = target[part]
    return _resolve(target)


def _pattern(pattern: str) -> st.SearchStrategy[str]:
    # ^...$ in the schema means the whole string; fullmatch keeps a final "\n" out.
    assert pattern.startswith("^") and pattern.endswith("$"), pattern
    return st.from_regex(pattern[1:-1], fullmatch=True)


def _typed(kind: str, node: dict[str, Any], where: str) -> st.SearchStrategy[Any]:
    if kind == "null":
        return st.none()
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        return st.integers(node.get("minimum", INT64_MIN), node.get("maximum", INT64_MAX))
    if kind == "number":
        return st.floats(
            node.get("minimum"), node.get("maximum"), allow_nan=False, allow_infinity=False
        )
    if kind == "string":
        if "pattern" in node:
            return _pattern(node["pattern"])
        return st.text(st.characters(exclude_categories=("Cs",)), min_size=node.get("minLength", 0))
    if kind == "array":
        items = from_schema(node["items"], where)
        return st.lists(items, min_size=node.get("minItems", 0), max_size=5, unique=True)
    if kind == "object":
        return _object(node, where)
    raise AssertionError(f"unsupported type {kind!r} at {where}")


def from_schema(node: dict[str, Any], where: str = "") -> st.SearchStrategy[Any]:
    """Values valid under one (resolved) schema node."""
    node = _resolve(node)
    if "const" in node:
        return st.just(node["const"])
    if "enum" in node:
        return st.sampled_from(node["enum"])
    kind = node["type"]
    kinds = kind if isinstance(kind, list) else [kind]
    return st.one_of(*(_typed(k, node, where) for k in kinds))


def _object(node: dict[str, Any], where: str) -> st.SearchStrategy[dict[str, Any]]:
    props = node.get("properties")
    if props is not None:
        required = set(node.get("required", ()))
        fixed = {k: from_schema(v, f"{where}/{k}") for k, v in props.items() if k in required}
        optional = {
            k: from_schema(v, f"{where}/{k}") for k, v in props.items() if k not in required
        }
        order = list(props)

        def ordered(d: dict[str, Any]) -> dict[str, Any]:
            return {k: d[k] for k in order if k in d}

        return st.fixed_dictionaries(fixed, optional=optional).map(ordered)
    # A map: keys from propertyNames, values from additionalProperties.
    names = node.get("propertyNames", {})
    if where.endswith("/events"):
        keys: st.SearchStrategy[str] = EVENT_NAMES
    elif "pattern" in names:
        keys = _pattern(names["pattern"])
    else:
        keys = st.text(
            st.characters(exclude_categories=("Cs",)), min_size=names.get("minLength", 0)
        )
    values = from_schema(node["additionalProperties"], f"{where}/*")
    return st.dictionaries(keys, values, min_size=node.get("minProperties", 0), max_size=4)


def json_for(schema_file: str) -> st.SearchStrategy[dict[str, Any]]:
    """Objects valid under a whole schema file (the warning file has its own below)."""
    if schema_file == WARNING_SCHEMA_FILE:
        return warning_json()
    return _object(schema_documents()[schema_file], "")


def stream_json(stream: str) -> st.SearchStrategy[dict[str, Any]]:
    """Schema-valid data-line objects of ``stream`` (cross-field rules not applied)."""
    return json_for(STREAM_FILES[stream])


# ---------------------------------------------------------------- cross-field rules


def _identity(d: dict[str, Any]) -> None:
    rank = min(d["rank"], INT64_MAX - 1)
    d["rank"] = d["global_rank"] = rank
    d["world_size"] = max(d["world_size"], rank + 1)
    d["local_world_size"] = min(d["local_world_size"], d["world_size"])
    d["local_rank"] = d["local_rank"] % d["local_world_size"]


def consistent(stream: str, d: dict[str, Any]) -> dict[str, Any]:
    """``d`` bent to meet the cross-field rules of ``stream`` (a new dict)."""
    d = dict(d)
    if stream != "stdout_stderr":
        _identity(d)
    if stream == "step_time":
        # Every step has the whole-step event (the schema requires it).
        events = dict(d["events"])
        events.setdefault(STEP_TIME_EVENT, next(iter(events.values())))
        d["events"] = events
        # Maps sorted by code point, as the producer writes them.
        d["events"] = {
            name: {dev: _phase(t) for dev, t in sorted(devices.items())}
            for name, devices in sorted(d["events"].items())
        }
    elif stream == "step_memory":
        if d["device"] == "cpu":
            d["peak_allocated_bytes"] = d["peak_reserved_bytes"] = None
    elif stream == "process":
        if d["gpu_available"] is not True:
            for key in (
                "gpu_count",
                "gpu_device_index",
                "gpu_memory_used_bytes",
                "gpu_memory_reserved_bytes",
                "gpu_memory_total_bytes",
            ):
                d[key] = None
    elif stream in ("system", "system_gpu"):
        d["local_rank"] = 0
        if stream == "system" and not d["gpu_available"]:
            d["gpu_count"] = 0
    elif stream == "runtime_environment":
        world, local_world = d["world_size"], d["local_world_size"]
        d["topology"] = (
            "single_process"
            if world == 1
            else "single_node_multi_process"
            if local_world == world
            else "multi_node"
        )
        if d["distributed_initialized"] and d["distributed_backend"] is None:
            d["distributed_backend"] = "gloo"
        if not d["distributed_initialized"]:
            d["distributed_backend"] = None
        d["python_version"] = "3.11.7"
        # Each coordinate's rank is below its size; parallel_source is null exactly
        # when parallel is (an absent key counts as null, and stays absent).
        parallel = d.get("parallel")
        if parallel is not None:
            d["parallel"] = {
                name: {"rank": c["rank"] % c["size"], "size": c["size"]}
                for name, c in sorted(parallel.items())
            }
            if d.get("parallel_source") is None:
                d["parallel_source"] = "declared"
        elif d.get("parallel_source") is not None:
            d["parallel_source"] = None
    elif stream == "stdout_stderr":
        d["line"] = d["line"].replace("\n", "")
    elif stream == "collectives":
        # wait_ms is null exactly when wait_measure says none.
        if d["wait_ms"] is None:
            d["wait_measure"] = "none"
        elif d["wait_measure"] == "none":
            d["wait_ms"] = None
        # A user phase name never starts with the reserved prefix.
        if d["phase"].startswith("_traceml_internal:") and d["phase"] not in _COLLECTIVE_PHASES:
            d["phase"] = "user_phase"
    return d


_COLLECTIVE_PHASES = frozenset(COLLECTIVE_PHASES)


def _phase(t: dict[str, Any]) -> dict[str, Any]:
    t = dict(t)
    if t["is_gpu"]:
        if t["gpu_ms"] is None:
            t["gpu_ms"] = t["cpu_ms"]
        t["duration_ms"] = t["gpu_ms"]
    else:
        t["duration_ms"] = t["cpu_ms"]
    return t


def as_dumped(stream: str, d: dict[str, Any]) -> dict[str, Any]:
    """The object ``dumps_line`` writes for the valid line ``d``: a key this producer
    always writes (``parallel``, collectives' ``peer_rank`` ...) that ``d`` lacks, as a
    line written before it existed does, comes back as null where its type allows; a
    null in a key written only when known (step_time's ``tokens``) is left out."""
    plan = ENCODER_PLANS[CLASSES[stream]]
    out: dict[str, Any] = {}
    for name, spec, flag in plan:
        if name in d:
            if d[name] is not None or flag != Flag.OMIT_NONE:
                out[name] = d[name]
        elif flag == Flag.ALWAYS and spec.nullable:
            out[name] = None
    return out


def consistent_json(stream: str) -> st.SearchStrategy[dict[str, Any]]:
    """Data-line objects of ``stream`` meeting its schema and its cross-field rules."""
    return stream_json(stream).map(lambda d: consistent(stream, d))


def _plain_text(text: str) -> str:
    return "".join(c if " " <= c <= "~" and c not in '"\\' else "x" for c in text)


def as_written(value: Any) -> Any:
    """A valid value as the exporter writes one (what the validator's fast check
    takes): short non-negative floats, printable ASCII strings, maps sorted again.
    The caller checks the result is still valid (a renamed key may collide)."""
    if type(value) is float:
        return round(abs(value) % 1e6, 3)
    if type(value) is str:
        return _plain_text(value)
    if type(value) is dict:
        items = [(_plain_text(k), as_written(v)) for k, v in value.items()]
        out = dict(items)
        return out if list(out) == [k for k, _ in items] else dict(sorted(out.items()))
    return value


@st.composite
def warning_json(draw: st.DrawFn) -> dict[str, Any]:
    """finalization_warning.json objects meeting the schema and the spec's rules."""
    schema = schema_documents()[WARNING_SCHEMA_FILE]
    reason = draw(st.sampled_from(schema["properties"]["reason"]["enum"]))
    moment = draw(
        st.datetimes(
            min_value=datetime.datetime(2000, 1, 1), max_value=datetime.datetime(2100, 1, 1)
        )
    )
    d: dict[str, Any] = {
        "status": "warning",
        "completed_at": moment.replace(tzinfo=datetime.timezone.utc).isoformat(),
        "reason": reason,
        "message": draw(st.text(st.characters(exclude_categories=("Cs",)), min_size=1)),
    }
    if reason not in ("export_incomplete", "monitoring_incomplete"):
        world = draw(st.integers(1, 64))
        missing = draw(st.sets(st.integers(0, world - 1), min_size=1))
        rest = sorted(set(range(world)) - missing)
        finished = draw(st.sets(st.sampled_from(rest))) if rest else set()
        d["expected_world_size"] = world
        d["finished_ranks"] = sorted(finished)
        d["missing_ranks"] = sorted(missing)
    monitoring: dict[str, Any] | None = None
    if reason == "monitoring_incomplete" or draw(st.booleans()):
        names = st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=12)
        monitoring = {
            "dropped_batches": draw(st.integers(0, INT64_MAX)),
            "by_sink": draw(
                st.dictionaries(
                    names, st.dictionaries(names, st.integers(0, INT64_MAX)), max_size=3
                )
            ),
            "not_started": draw(st.dictionaries(names, names, max_size=2)),
        }
    if reason == "export_incomplete" or (reason != "monitoring_incomplete" and draw(st.booleans())):
        count = st.integers(0, INT64_MAX)
        export = {
            "written_records": draw(count),
            "dropped_batches": draw(count),
            "failed_records": draw(count),
            "skipped_items": draw(count),
            "exporter_failed": draw(st.booleans()),
        }
        if not (
            export["dropped_batches"]
            or export["failed_records"]
            or export["skipped_items"]
            or export["exporter_failed"]
        ):
            export["failed_records"] = 1
        d["export"] = export
    if monitoring is not None:
        d["monitoring"] = monitoring  # after export: the schema's key order
    return d


def closing_json() -> st.SearchStrategy[dict[str, Any]]:
    """Closing-line objects."""
    return json_for(CLOSING_SCHEMA_FILE)


# ---------------------------------------------------------------- typed records


def _load(cls: type[Any], d: dict[str, Any]) -> Any:
    try:
        return LOADERS[cls](d, ())
    except RecordError as exc:  # a strategy bug, not a finding about the code
        raise AssertionError(f"strategy drew an invalid {cls.__name__}: {exc}") from exc


def records(kind: str) -> st.SearchStrategy[Any]:
    """Typed records of a stream name, ``"closing"`` or ``"warning"``."""
    if kind == "closing":
        return closing_json().map(lambda d: _load(ClosingLine, d))
    if kind == "warning":
        return warning_json().map(lambda d: _load(FinalizationWarning, d))
    return consistent_json(kind).map(lambda d: _load(CLASSES[kind], d))


KINDS = (*(spec.name for spec in STREAMS), "closing", "warning")
"""Every kind of line: the streams, the closing line and the warning file."""
