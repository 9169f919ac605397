"""One record ↔ one JSON line: compact, schema-ordered, strict both ways.

Writer and reader agree with ``traceml validate``: strict :func:`loads_line` raises
on exactly the single-line problems the validator reports (schema, key order, sorted
maps, integers written as integers, the named rules of :mod:`traceml_records._rules`),
and :func:`dumps_line` refuses to write what strict :func:`loads_line` would refuse.
A record a generated loader built is valid by construction and carries a mark
(``is_checked``), so it is written at full speed; a record built by calling its class
is checked once (its line goes through strict :func:`loads_line`) and then marked.
Mutating a marked record's maps in place afterwards is not supported.

Non-finite floats: orjson writes NaN and ±Infinity as ``null``. In a nullable float
field that is exactly what the spec asks for ("a non-finite measurement is written as
``null`` where the field is nullable"), so :func:`dumps_line` lets it through. In a
non-nullable float field it would make an invalid line, so :func:`dumps_line` raises
:class:`RecordError` naming the field instead.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias

import orjson

from traceml_records import _extensions
from traceml_records._errors import Path, RecordError, describe
from traceml_records._generated.checks import CHECKS, WARNING_CHECK
from traceml_records._generated.records import (
    DUMPERS,
    ENCODER_PLANS,
    LOADERS,
    MAP_KEY_RULES,
    NON_NULLABLE_FLOAT_KEYS,
    ClosingLine,
    FinalizationWarning,
    ProcessRecord,
    RuntimeEnvironmentRecord,
    StdoutStderrRecord,
    StepMemoryRecord,
    StepTimeRecord,
    SystemGpuRecord,
    SystemRecord,
    is_checked,
    mark_checked,
)
from traceml_records._generated.registry import STREAMS
from traceml_records._rules import LineCheck, line_checks, line_findings
from traceml_records._schemas import WARNING_SCHEMA_FILE, rs_validators, schema_errors

StreamRecord: TypeAlias = (
    StepTimeRecord
    | StepMemoryRecord
    | ProcessRecord
    | SystemRecord
    | SystemGpuRecord
    | RuntimeEnvironmentRecord
    | StdoutStderrRecord
)
"""A data record of any export stream."""

AnyRecord: TypeAlias = StreamRecord | ClosingLine | FinalizationWarning
"""Anything :func:`loads_line` can return."""

# The step_time event name rules, as the schema states them (required event,
# ``propertyNames`` if/then) and codegen renders them.
_REQUIRED_EVENTS, _PREFIX, BUILTIN_EVENTS = MAP_KEY_RULES[(StepTimeRecord, "events")]
assert _PREFIX is not None and len(_REQUIRED_EVENTS) == 1
RESERVED_EVENT_PREFIX: str = _PREFIX
"""Prefix of the event names TraceML reserves for itself."""
STEP_TIME_EVENT: str = _REQUIRED_EVENTS[0]
"""The event every step_time line has: the whole step."""
# BUILTIN_EVENTS: the reserved event names this release writes (the schema's enum).

_STREAM_LOADERS: dict[str, Any] = {spec.name: LOADERS[spec.record_class] for spec in STREAMS}
_STREAM_NAMES = ", ".join(spec.name for spec in STREAMS)
_LOAD_CLOSING = LOADERS[ClosingLine]
_LOAD_WARNING = LOADERS[FinalizationWarning]
# Marker bytes → field names, so a marker hit can be traced back to a value.
_MARKER_FIELDS: dict[type[Any], frozenset[str]] = {
    cls: frozenset(m.split(b'"')[1].decode() for m in markers)
    for cls, markers in NON_NULLABLE_FLOAT_KEYS.items()
}
_APPEND_NEWLINE = orjson.OPT_APPEND_NEWLINE


def _marker_scan(markers: tuple[bytes, ...]) -> Callable[[bytes], object] | None:
    """One pass over the line for all markers (a bytes search per marker costs more)."""
    if not markers:
        return None
    return re.compile(b"|".join(re.escape(m) for m in markers)).search


_MARKER_SCAN = {cls: _marker_scan(markers) for cls, markers in NON_NULLABLE_FLOAT_KEYS.items()}


def _non_finite(obj: Any, names: frozenset[str], path: Path) -> Iterator[Path]:
    """Paths of non-finite floats held under one of ``names`` inside ``obj``."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            if (
                key in names
                and isinstance(value, float)
                and value - value != 0.0  # NaN and ±inf only
            ):
                yield (*path, key)
            elif isinstance(value, dict | list):
                yield from _non_finite(value, names, (*path, key))
    elif isinstance(obj, list):
        for index, value in enumerate(obj):
            yield from _non_finite(value, names, (*path, index))


def _encode(record: object, obj: dict[str, Any], option: int) -> bytes:
    try:
        data = orjson.dumps(obj, option=option)
    except orjson.JSONEncodeError as exc:
        # Integers beyond 64 bits and lone surrogates in strings cannot be written.
        raise RecordError((), f"cannot be serialized: {exc}") from None
    scan = _MARKER_SCAN[type(record)]
    if scan is not None and scan(data) is not None:
        for path in _non_finite(obj, _MARKER_FIELDS[type(record)], ()):
            raise RecordError(path, "non-finite number in a field that cannot be null")
    return data


def _py_dumps_line(record: AnyRecord, *, include_hostname: bool = False) -> bytes:
    """Serialize ``record`` to one compact JSON line ending in ``\\n``.

    Keys follow the schema order and maps are sorted. ``hostname`` is written only
    when ``include_hostname`` is true and the stream carries it. A non-finite float
    becomes ``null`` in a nullable field; in any other field it raises
    :class:`RecordError`, as do integers beyond 64 bits and lone surrogates.
    """
    dumper = DUMPERS.get(type(record))
    if dumper is None:
        raise TypeError(f"not a TraceML record: {type(record).__name__}")
    data = _encode(record, dumper(record, include_hostname), _APPEND_NEWLINE)
    if not is_checked(record):
        _check_written(record, data)
    return data


def _check_written(record: object, data: bytes) -> None:
    """Refuse (RecordError naming the field) a line strict loads_line would refuse.

    Only records built by calling their class get here, once: the mark set after a
    pass makes later dumps of the same record take the fast path.
    """
    loads_line(data, strict=True)
    mark_checked(record)


def _load_speedups() -> ModuleType | None:
    """The configured C encoder, or None (not built, or TRACEML_PURE_PYTHON set).

    Its ``dumps_line`` writes the same bytes as :func:`_py_dumps_line` and hands it
    every record it does not handle itself, so errors and odd values behave the same
    either way.
    """
    _speedups = _extensions.load()
    if _speedups is None:
        return None
    _speedups.configure(ENCODER_PLANS, _py_dumps_line, orjson.dumps)
    return _speedups


_speedups_module = _load_speedups()
_c_dumps_line = _speedups_module.dumps_line if _speedups_module is not None else None
SPEEDUPS = _speedups_module is not None
"""Whether :func:`dumps_line` runs in C (the built extension, not disabled)."""

encode_items: Callable[..., tuple[bytes, int, list[tuple[int, int]]]] | None = (
    _speedups_module.encode_items if _speedups_module is not None else None
)
"""The C item encoder (``_speedups.encode_items``), or None without the extension.

``encode_items(items, record_class, first_field, prefix, max_string_bytes, step_rules,
conditions, batch_fields)`` returns ``(data, count, pending)``: ``data`` holds, in item
order, the line of every item it can vouch for (plainly valid: exact types, bounds and
sets of the schema, the class's schema ``conditions`` (``ENCODER_CONDITIONS`` with
fields by index), and with ``step_rules`` the step_time rules), each ``prefix`` + the
item's fields (the record's fields from index ``first_field`` on); ``batch_fields``
(``((field index, value), ...)`` or None) are the batch's fields the record places
among the item's (process's ``pid``): each value is checked as an item's value of
that field would be and written at its index in every line, and one it cannot vouch
for leaves every item pending; ``count`` says how many; ``pending`` lists ``(item
index, offset in data)`` of every other item, for the caller to take through the
strict Python loaders and put (or not) at that offset.
"""

split_batch: Callable[[bytes], tuple[bytes, int, int, int] | None] | None = (
    _speedups_module.split_batch if _speedups_module is not None else None
)
"""``split_batch(body)`` (C, or None without the extension): ``(stream, identity_start,
identity_end, items_start)`` of a batch body written as our senders write it (compact,
keys ``v, token, type, stream, identity, items``), else None. The identity is only
delimited, for orjson to read."""

encode_batch: Callable[..., tuple[bytes, int] | None] | None = (
    _speedups_module.encode_batch if _speedups_module is not None else None
)
"""The C batch encoder (``_speedups.encode_batch``), or None without the extension.

``encode_batch(body, items_start, record_class, first_field, prefix, max_string_bytes,
step_rules, conditions, batch_fields)`` returns ``(data, count)``: the lines :func:`encode_items` writes for
orjson's reading of the items array at ``items_start`` of ``body``, read from the bytes
without a Python object per item; or None when the body is not in the plain form our
senders write or :func:`encode_items` would leave any item to Python (the caller then
parses the body and takes that path).
"""

if TYPE_CHECKING:
    dumps_line = _py_dumps_line
else:
    dumps_line = _c_dumps_line or _py_dumps_line


def dumps_lines(
    records: Sequence[object], record_class: type[Any], *, include_hostname: bool = False
) -> tuple[list[bytes], int]:
    """The lines of ``records`` (all expected to be ``record_class``), and how many had none.

    A record of another class, or one :func:`dumps_line` refuses, gets no line and is
    counted. Same lines as :func:`dumps_line` record by record, but the markers of a
    non-finite value are searched once over the whole batch, and only a batch where one
    shows up goes through :func:`dumps_line` one record at a time.
    """
    dumper = DUMPERS.get(record_class)
    if dumper is None:
        raise TypeError(f"not a TraceML record: {record_class.__name__}")
    if _c_dumps_line is not None:
        c_encode = functools.partial(_c_dumps_line, include_hostname=include_hostname)
        return _encode_each(records, record_class, c_encode)

    def encode(record: Any) -> bytes:
        if not is_checked(record):
            return _py_dumps_line(record, include_hostname=include_hostname)
        # No non-finite check here: one scan over the whole batch below.
        return orjson.dumps(dumper(record, include_hostname), option=_APPEND_NEWLINE)

    lines, bad = _encode_each(records, record_class, encode)
    scan = _MARKER_SCAN[record_class]
    if scan is None or scan(b"".join(lines)) is None:
        return lines, bad
    # Rare: a marker showed up; give every record its exact one-by-one treatment.
    exact = functools.partial(_py_dumps_line, include_hostname=include_hostname)
    return _encode_each(records, record_class, exact)


def _encode_each(
    records: Sequence[object], record_class: type[Any], encode: Callable[[Any], bytes]
) -> tuple[list[bytes], int]:
    lines: list[bytes] = []
    append = lines.append
    bad = 0
    for record in records:
        if type(record) is not record_class:
            bad += 1
            continue
        try:
            append(encode(record))
        except (RecordError, ValueError, TypeError):
            bad += 1
    return lines, bad


def _parse(data: bytes | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise RecordError((), f"invalid JSON: {exc}") from None


def record_from_object(obj: Any) -> AnyRecord:
    """Build the typed record of one parsed line (dispatch as non-strict :func:`loads_line`)."""
    return _trusted_only_if_clean(_load_object(obj), obj)


def _load_object(obj: Any) -> AnyRecord:
    if type(obj) is not dict:
        raise RecordError((), f"expected object, got {describe(obj)}")
    if "closing" in obj:
        closing = obj["closing"]
        if closing is not True:
            raise RecordError(
                ("closing",),
                f"expected true (data lines never carry closing), got {describe(closing)}",
            )
        return _LOAD_CLOSING(obj, ())  # type: ignore[no-any-return]
    if "status" in obj:
        return _load_warning(obj)
    try:
        stream = obj["stream"]
    except KeyError:
        raise RecordError(("stream",), "required key is missing") from None
    loader = _STREAM_LOADERS.get(stream) if type(stream) is str else None
    if loader is None:
        raise RecordError(
            ("stream",), f"unknown stream {describe(stream)}; expected one of {_STREAM_NAMES}"
        )
    return loader(obj, ())  # type: ignore[no-any-return]


class _LineForm:
    """What strict loading checks beyond the loader, for one stream (from the registry)."""

    __slots__ = ("checks", "not_null", "order", "orders", "sorted_map")

    def __init__(self, record_class: type[Any], rules: tuple[str, ...], required: set[str]) -> None:
        plan = ENCODER_PLANS[record_class]
        self.order = tuple(field[0] for field in plan)
        # Every key order a line may have: the schema order less any set of its
        # optional keys (hostname, keys omitted when unknown such as gpu_uuid, and keys
        # that lines written before them lack, such as collectives' group).
        optional = [field[0] for field in plan if field[0] not in required]
        orders = set()
        for mask in range(1 << len(optional)):
            left_out = {name for bit, name in enumerate(optional) if mask >> bit & 1}
            orders.add(tuple(k for k in self.order if k not in left_out))
        self.orders = frozenset(orders)
        # Optional keys that cannot be null (gpu_uuid, collectives' group): the loader
        # reads a null as absent, the schema refuses it. (A nullable one, such as
        # step_time's tokens, may be null.)
        self.not_null = tuple(
            (field[0], _JSON_TYPES[field[1].kind])
            for field in plan
            if field[0] not in required and field[0] != "hostname" and not field[1].nullable
        )
        self.checks: tuple[LineCheck, ...] = line_checks(rules)
        # step_time's events: names and each device map sorted (a line format rule).
        self.sorted_map = "events" if "events" in self.order else None


_JSON_TYPES = ("integer", "number", "boolean", "string", "object", "object", "array")
"""JSON type name of each plan Kind (by its code: OBJECT and MAP are both objects)."""
_LINE_FORMS = {
    spec.name: _LineForm(
        spec.record_class,
        spec.rules,
        set(CHECKS[spec.name].required),
    )
    for spec in STREAMS
}
_CLOSING_ORDER = tuple(field[0] for field in ENCODER_PLANS[ClosingLine])


def line_problems(obj: dict[str, Any]) -> list[tuple[Path, str]]:
    """Problems of a line the loader accepted: key order, sorted maps, named rules.

    The same findings, in the same order, as ``traceml validate`` reports for a line
    that passes its schema.
    """
    if "closing" in obj:
        if tuple(obj) != _CLOSING_ORDER:
            return [((), f"keys are not in schema order ({', '.join(_CLOSING_ORDER)})")]
        return []
    if "status" in obj:
        return _warning_problems(obj)
    form = _LINE_FORMS.get(obj.get("stream"))  # type: ignore[arg-type]
    if form is None:
        return []
    found: list[tuple[Path, str]] = []
    if tuple(obj) not in form.orders:
        found.append(((), f"keys are not in schema order ({', '.join(form.order)})"))
    found.extend(_null_where_left_out(form, obj))
    if form.sorted_map is not None:
        found.extend(_unsorted(obj[form.sorted_map], form.sorted_map))
    found.extend(line_findings(form.checks, obj))
    return found


def value_problems(obj: dict[str, Any]) -> list[tuple[Path, str]]:
    """The problems of :func:`line_problems` that are of a data line's values, not of
    how it is written (key order, maps' order): a null where the key is left out, the
    named rules."""
    form = _LINE_FORMS.get(obj.get("stream"))  # type: ignore[arg-type]
    if form is None:
        return []
    return [*_null_where_left_out(form, obj), *line_findings(form.checks, obj)]


def _null_where_left_out(form: _LineForm, obj: dict[str, Any]) -> Iterator[tuple[Path, str]]:
    for key, json_type in form.not_null:
        if key in obj and obj[key] is None:
            yield (key,), f'null is not of type "{json_type}"'


_WARNING_ORDER = tuple(field[0] for field in ENCODER_PLANS[FinalizationWarning])


@functools.cache
def _warning_checks() -> tuple[LineCheck, ...]:
    # The check plan names its rules; read once, when a warning is first checked.
    return line_checks(WARNING_CHECK.rules)


def _warning_problems(obj: dict[str, Any]) -> list[tuple[Path, str]]:
    """Key order and the named rules of finalization_warning.json (schema-valid ``obj``)."""
    found: list[tuple[Path, str]] = []
    order = [k for k in _WARNING_ORDER if k in obj]
    if list(obj) != order:
        found.append(((), f"keys are not in schema order ({', '.join(order)})"))
    found.extend(line_findings(_warning_checks(), obj))
    return found


def _unsorted(events: dict[str, dict[str, Any]], field: str) -> Iterator[tuple[Path, str]]:
    names = list(events)
    if len(names) > 1 and names != sorted(names):
        yield (field,), "event names are not sorted by code point"
    for name, devices in events.items():
        if len(devices) > 1:
            keys = list(devices)
            if keys != sorted(keys):
                yield (field, name), "device keys are not sorted"


def loads_line(data: bytes | str, strict: bool = True) -> AnyRecord:
    """Parse one line (a data line, a closing line or the warning object).

    A line with ``closing`` is a :class:`ClosingLine`, one with ``status`` a
    :class:`FinalizationWarning`; any other line is a record of the stream its
    ``stream`` names. Anything that breaks the schema raises :class:`RecordError`
    with a JSON pointer to the offending value.

    ``strict`` (the default) also raises on every other single-line problem
    ``traceml validate`` reports: keys out of schema order, unsorted event maps and
    the stream's named rules (``rank == global_rank``, ``duration_ms`` matching its
    timing, ...). ``strict=False`` keeps the schema checks only, for lines of other
    producers whose values you want even when they break a cross-field rule.
    """
    obj = _parse(data)
    record = _load_object(obj)
    if strict:
        found = line_problems(obj)
        if found:
            raise RecordError(*found[0])
        return record
    return _trusted_only_if_clean(record, obj)


def _trusted_only_if_clean(record: AnyRecord, obj: dict[str, Any]) -> AnyRecord:
    """Clear the loader's mark on a record whose line breaks a non-schema rule.

    The loader marks every record it builds; one that breaks a named rule is not
    valid, so dumps_line must check (and refuse) it.
    """
    if line_problems(obj):
        mark_checked(record, False)
    return record


def dumps_warning_file(warning: FinalizationWarning) -> bytes:
    """The pretty-printed content of ``finalization_warning.json`` (ends in ``\\n``)."""
    if type(warning) is not FinalizationWarning:
        raise TypeError(f"expected FinalizationWarning, got {type(warning).__name__}")
    obj = DUMPERS[FinalizationWarning](warning, False)
    return _encode(warning, obj, orjson.OPT_INDENT_2 | _APPEND_NEWLINE)


def loads_warning_file(data: bytes | str) -> FinalizationWarning:
    """Parse ``finalization_warning.json`` content strictly (RecordError on any fault).

    The schema, then the named rules the schema lists (``x-traceml-rules``), as
    ``traceml validate`` checks the file and finalize checks what it writes.
    """
    obj = _parse(data)
    warning = _load_warning(obj)
    found = _warning_problems(obj)
    if found:
        raise RecordError(*found[0])
    return warning


def _load_warning(obj: Any) -> FinalizationWarning:
    warning: FinalizationWarning = _LOAD_WARNING(obj, ())
    # The generated loader leaves the schema's allOf/dependentRequired rules (which
    # keys go together, which reason needs which block) to a JSON Schema validator.
    validator = rs_validators()[WARNING_SCHEMA_FILE]
    if not validator.is_valid(obj):
        path, message = schema_errors(validator, obj)[0]
        raise RecordError(path, message)
    return warning
