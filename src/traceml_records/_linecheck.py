"""One line of an export file checked on its own: the full path of ``traceml validate``.

A line is parsed with orjson and checked against its JSON Schema with a compiled
``jsonschema_rs`` validator (``is_valid``; the error list is built only for a bad
line), then gets what a schema cannot say, from the one place that says it for the
codec too (``line_problems``: key order, sorted maps and the named rules of
``traceml_records._rules``), and integers written as integers (JSON Schema's integer
accepts ``1.0``; the check plans say where an integer is due). A line with none of
these problems is a valid line: the one scan (``_scan``) takes exactly those, and
reports the others as ``invalid`` (or ``not_json``).
"""

from __future__ import annotations

import functools
from typing import Any

import attrs
import orjson

from traceml_records._checkplan import ARRAY, INTEGER, MAP, OBJECT, CheckPlan, ValueCheck
from traceml_records._codec import line_problems, value_problems
from traceml_records._errors import Path, describe, json_pointer
from traceml_records._generated.checks import CHECKS, CLOSING_CHECK, WARNING_CHECK
from traceml_records._generated.registry import STREAMS
from traceml_records._schemas import (
    CLOSING_SCHEMA_FILE,
    WARNING_SCHEMA_FILE,
    rs_validators,
    schema_errors,
)

NOT_INT = "expected an integer written without fraction or exponent, got"

# (pointer, message) pairs: what the per-line checks produce before a file and a
# line number are attached.
Found = list[tuple[str, str]]


@attrs.frozen
class Problem:
    """One thing wrong: where (file, line, JSON pointer) and what."""

    file: str | None
    line: int | None
    pointer: str
    message: str

    def __str__(self) -> str:
        where = ""
        if self.file is not None:
            where = f"{self.file}:{self.line}: " if self.line is not None else f"{self.file}: "
        return f"{where}{said(self.pointer, self.message)}"


def said(pointer: str, message: str) -> str:
    """One problem of a line as every report words it: ``/step: 0 is less than the
    minimum of 1`` (its JSON pointer, ``/`` for the whole line, then what is wrong)."""
    return f"{pointer or '/'}: {message}"


# --------------------------------------------------------------------------- plans


def _float_ints(value: Any, check: ValueCheck, path: Path, out: Found) -> None:
    """Report floats where the check plan wants integers (JSON Schema accepts ``1.0``)."""
    if type(value) is float:
        if check.kind == INTEGER:
            out.append((json_pointer(path), f"{NOT_INT} {describe(value)}"))
    elif type(value) is dict:
        if check.kind == OBJECT:
            fields = {f.name: f.check for f in check.fields}
            for key, item in value.items():
                sub = fields.get(key)
                if sub is not None:
                    _float_ints(item, sub, (*path, key), out)
        elif check.kind == MAP and check.value is not None:
            for key, item in value.items():
                _float_ints(item, check.value, (*path, key), out)
    elif type(value) is list and check.kind == ARRAY and check.value is not None:
        for index, item in enumerate(value):
            _float_ints(item, check.value, (*path, index), out)


def _as_object(plan: CheckPlan) -> ValueCheck:
    return ValueCheck(kind=OBJECT, fields=plan.fields)


_CLOSING_OBJECT = _as_object(CLOSING_CHECK)
_WARNING_OBJECT = _as_object(WARNING_CHECK)


def _schema_problems(validator: Any, obj: Any) -> Found:
    return [(json_pointer(path), message) for path, message in schema_errors(validator, obj)]


# ------------------------------------------------------------------ per-line checks
# A schema-valid line then gets what the schema cannot say, from the one place that
# says it for the codec too (``line_problems``: key order, sorted maps and the named
# rules of ``traceml_records._rules``), so ``traceml validate`` and strict
# ``loads_line`` report the same lines.


_INT64 = float(1 << 63)


def _int_written_as_float(at: str, value: float, out: Found, huge: Found) -> None:
    """An integer field holding a float: how it is written, unless it is past what a
    64-bit integer holds (a huge integer in the line, which orjson reads as a float):
    then its value is wrong (``huge``)."""
    if -_INT64 <= value < _INT64:
        out.append((at, f"{NOT_INT} {describe(value)}"))
    else:
        problem = (at, f"{describe(value)} is outside the 64-bit integer range")
        out.append(problem)
        huge.append(problem)


def _event_int_floats(d: dict[str, Any], out: Found, huge: Found) -> None:
    """``n_calls`` written as a float (JSON Schema's integer accepts ``1.0``)."""
    for name, devices in d["events"].items():
        for device, t in devices.items():
            if type(t["n_calls"]) is float:
                at = json_pointer(("events", name, device, "n_calls"))
                _int_written_as_float(at, t["n_calls"], out, huge)


@attrs.frozen
class _Kind:
    """What the per-line checks of one stream need, from its check plan once."""

    validator: Any
    int_keys: tuple[str, ...]

    def check(self, d: dict[str, Any]) -> tuple[bool, Found, Found]:
        """Whether the line passes its schema, its problems (schema, then the rest), and
        those of them that are of its values' range (an integer past 64 bits)."""
        if not self.validator.is_valid(d):
            return False, _schema_problems(self.validator, d), []
        out: Found = []
        huge: Found = []
        for key in self.int_keys:
            value = d.get(key)
            if type(value) is float:
                _int_written_as_float(f"/{key}", value, out, huge)
        if "events" in d:
            _event_int_floats(d, out, huge)
        out.extend((json_pointer(path), message) for path, message in line_problems(d))
        return True, out, huge


@functools.cache
def _kinds() -> dict[str, _Kind]:
    validators = rs_validators()
    return {
        spec.name: _Kind(
            validator=validators[spec.schema_file],
            int_keys=tuple(f.name for f in CHECKS[spec.name].fields if f.check.kind == INTEGER),
        )
        for spec in STREAMS
    }


def data_line(
    d: dict[str, Any], stream: str | None
) -> tuple[str | None, bool, Found, tuple[str, str] | None]:
    """A JSON object that is no closing line, checked as a data line of a ``stream``
    file (None: the file's stream is not known yet): ``(the line's stream, whether it
    passes its schema, its problems, the first problem of its values or None)``. A
    line whose only problems are of how it is written (key order, maps' order, an
    integer written ``1.0``) holds a valid line's values (None); the line's stream is
    None when it names none this file may hold."""
    if "closing" in d:
        problem = _closing_not_true(d)
        return None, False, [problem], problem
    name = d.get("stream")
    kind = _kinds().get(name) if type(name) is str else None
    if kind is None:
        problem = (
            ("", "a finalization warning object is not an export line")
            if "status" in d
            else _unknown_stream(d)
        )
        return None, False, [problem], problem
    if stream is not None and name != stream:
        problem = ("/stream", f"a {name} line in a {stream} file")
        return None, False, [problem], problem
    valid, found, huge = kind.check(d)
    if not valid:
        return name, False, found, found[0]
    if huge:
        return name, True, found, huge[0]
    wrong = value_problems(d) if found else []
    return name, True, found, (json_pointer(wrong[0][0]), wrong[0][1]) if wrong else None


def closing_valid(d: dict[str, Any]) -> bool:
    """Whether a closing line's object passes its schema."""
    return bool(rs_validators()[CLOSING_SCHEMA_FILE].is_valid(d))


def check_closing(d: dict[str, Any]) -> Found:
    """A closing line's problems: schema, key order, integers written as integers."""
    validator = rs_validators()[CLOSING_SCHEMA_FILE]
    if not validator.is_valid(d):
        return _schema_problems(validator, d)
    out: Found = []
    if tuple(d) != CLOSING_CHECK.names:
        out.append(("", f"keys are not in schema order ({', '.join(CLOSING_CHECK.names)})"))
    _float_ints(d, _CLOSING_OBJECT, (), out)
    return out


def check_warning(d: Any) -> Found:
    """Schema, integers written as integers, then key order and the named rules
    (``line_problems``, as strict loading and finalize check them)."""
    validator = rs_validators()[WARNING_SCHEMA_FILE]
    if not validator.is_valid(d):
        return _schema_problems(validator, d)
    out: Found = []
    _float_ints(d, _WARNING_OBJECT, (), out)
    out.extend((json_pointer(path), message) for path, message in line_problems(d))
    return out


def validate_line(data: bytes | str) -> list[Problem]:
    """Problems of one line on its own: JSON, schema and cross-field rules.

    The line may be a data line of any stream, a closing line or the warning object.
    Cross-line rules need the whole file; see :func:`validate_paths`.
    """
    try:
        d = orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        return [Problem(None, None, "", f"invalid JSON: {exc}")]
    return [Problem(None, None, p, m) for p, m in _check_object(d)]


def _check_object(d: Any) -> Found:
    if type(d) is not dict:
        return [("", f"expected object, got {describe(d)}")]
    if "closing" in d:
        if d["closing"] is not True:
            return [_closing_not_true(d)]
        return check_closing(d)
    if "status" in d:
        return check_warning(d)
    stream = d.get("stream")
    kind = _kinds().get(stream) if type(stream) is str else None
    if kind is None:
        return [_unknown_stream(d)]
    return kind.check(d)[1]


def _closing_not_true(d: dict[str, Any]) -> tuple[str, str]:
    return (
        "/closing",
        f"expected true (data lines never carry closing), got {describe(d['closing'])}",
    )


def _unknown_stream(d: dict[str, Any]) -> tuple[str, str]:
    if "stream" not in d:
        return ("/stream", "required key is missing")
    names = ", ".join(spec.name for spec in STREAMS)
    return ("/stream", f"unknown stream {describe(d['stream'])}; expected one of {names}")
