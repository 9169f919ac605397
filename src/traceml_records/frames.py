"""Typed tables from the export files: Arrow, pandas, polars and DuckDB.

The column layouts are generated from the JSON Schemas (``_generated/tables.py``,
documented in docs/reference/tables.md): one table per stream, and
``step_time_phases``, the ``events`` map of step_time flattened to one row per rank,
step, event and device.

Every loader reads a file that is still being written (a last line without its
newline is left out), never returns a closing line as a row (the last one is
reported: :attr:`Loaded.closing`, the table's metadata, ``DataFrame.attrs``; one
before the last line means two runs in one file, reported as well), and with
``validate=True`` checks every line against the schemas first.

Without ``validate``, a data line whose values the strict validator rejects (NaN or
Infinity, a value outside its schema's range such as a negative duration or
``n_calls`` 0, a required key missing, a broken identity or duration rule, a key the
schema does not know) is left out of the rows and counted (:attr:`Loaded.bad_lines`,
with the first :attr:`Loaded.problems`); repeated keys are counted
(:attr:`Loaded.duplicate_keys`) and kept. What cannot be read at all (not JSON, not
UTF-8, a value of the wrong type) raises :class:`FramesError` naming the file.

The file is read into memory once (never memory-mapped: a file truncated or
rewritten while it is mapped kills the reader with SIGBUS), then cut after its last
complete line.

pyarrow is needed (the ``frames`` extra); pandas, polars and duckdb only for their
own functions.

Speed: a file as the exporter writes it (every data line one the validator's fast
check accepts: valid, in schema order, keys unique, seq never going back; its closing
line, if any, last and matching) is read by that check (``_fastcheck``, in C) straight
into the tables' columns, in one pass and no Python object per line; rows come in
file order, a line's phase rows in its event and device order. Any other file goes
the general way: pyarrow's multithreaded JSON reader parses the lines with an explicit
schema for the scalar columns and infers only the ``events`` map, whose keys vary
(user phase names); the map is then flattened column-wise, and the value checks are
column-wise too (rows of the long tables then come block by block, event by event).
Either way, sort when the order matters. bench/frames.py compares it with
``pandas.read_json`` and the untyped ``pyarrow.json.read_json``.
"""

from __future__ import annotations

import functools
import math
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

try:
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pajson
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "traceml_records.frames needs pyarrow: pip install 'traceml-ai[frames]'"
    ) from exc

from traceml_records._checkplan import BOOLEAN, INTEGER, NUMBER, ValueCheck
from traceml_records._fastcheck import frames_layout
from traceml_records._generated.checks import CHECKS, CLOSING_CHECK
from traceml_records._generated.tables import LONG_TABLES, NESTED_FIELDS, TABLE_STREAM, TABLES
from traceml_records._linecheck import check_closing
from traceml_records._lines import closing_of
from traceml_records._scan import FileScan
from traceml_records._scan_py import Column

__all__ = [
    "TABLE_NAMES",
    "FramesError",
    "Loaded",
    "arrow_schema",
    "closing_line",
    "load",
    "load_arrow",
    "register",
    "to_pandas",
    "to_polars",
]

TABLE_NAMES: tuple[str, ...] = tuple(TABLES)
"""Every table: one per stream, plus the long tables (``step_time_phases``)."""

_TYPES: dict[str, Any] = {
    "int64": pa.int64(),
    "float64": pa.float64(),
    "bool": pa.bool_(),
    "string": pa.string(),
}
_BLOCK_SIZE = 16 << 20
"""Bytes per parse block: big enough for the threads to stay busy, small for memory.
A longer line gets a bigger block (up to :data:`_MAX_BLOCK_SIZE`)."""
_MAX_BLOCK_SIZE = (1 << 31) - 1
"""pyarrow's block size is an int32: no line can be longer."""
_META_CLOSING = b"traceml.closing"
_META_PARTIAL = b"traceml.partial_last_line"
_META_FILE = b"traceml.file"
_META_INFO = b"traceml.info"
_MAX_PROBLEMS = 10
"""Problems kept as text (:attr:`Loaded.problems`); every bad line is counted."""
_CLOSING_FIELDS = ("closing", "written_records", "dropped_batches")
"""Closing-line keys parsed with every file, to tell closing lines from data lines."""
_INT64_MAX = (1 << 63) - 1


class FramesError(ValueError):
    """The input cannot be loaded; the message is one line naming the file."""


def arrow_schema(table: str) -> Any:
    """The ``pyarrow.Schema`` of ``table`` (a stream name or ``step_time_phases``)."""
    try:
        columns = TABLES[table]
    except KeyError:
        raise FramesError(f"unknown table {table!r} (known: {', '.join(TABLE_NAMES)})") from None
    return pa.schema([pa.field(n, _type(t), nullable=null) for n, t, null in columns])


def _type(name: str) -> Any:
    """An Arrow type from its generated name: int64, float64, bool, string, list<T>."""
    if name.startswith("list<") and name.endswith(">"):
        return pa.list_(_type(name[5:-1]))
    return _TYPES[name]


@dataclass(frozen=True)
class Loaded:
    """What loading one stream's file gave: its tables and what was left out."""

    path: Path
    stream: str
    tables: dict[str, Any]
    """Table name -> ``pyarrow.Table`` (the stream's own and its long tables)."""
    closing: dict[str, Any] | None
    """The closing line (left out of the rows); None while the file is being written."""
    partial_last_line: bool
    """A last line without its newline was left out (the exporter is writing it)."""
    data_lines: int = field(default=0)
    """Complete data lines in the file (closing lines apart), bad ones included."""
    bad_lines: int = field(default=0)
    """Data lines left out of the rows: values the strict validator rejects."""
    problems: tuple[str, ...] = field(default=())
    """The first problems found (``file:line: /pointer: message``), at most ten."""
    duplicate_keys: int = field(default=0)
    """Rows whose stream key an earlier row has already (kept, not merged)."""
    earlier_closings: tuple[dict[str, Any], ...] = field(default=())
    """Closing lines before the last line (``{"line": n, "closing": {...}}``)."""
    runs_concatenated: bool = field(default=False)
    """A closing line is followed by data lines: the file holds more than one run."""

    def info(self) -> dict[str, Any]:
        """What was left out, as JSON-able data (also in each table's metadata)."""
        return {
            "file": str(self.path),
            "closing": self.closing,
            "partial_last_line": self.partial_last_line,
            "data_lines": self.data_lines,
            "bad_lines": self.bad_lines,
            "problems": list(self.problems),
            "duplicate_keys": self.duplicate_keys,
            "earlier_closings": list(self.earlier_closings),
            "runs_concatenated": self.runs_concatenated,
        }


# --------------------------------------------------------------------------- paths


def _export_folder(folder: Path) -> Path:
    if (folder / "aggregator" / "export").is_dir():
        return folder / "aggregator" / "export"
    if folder.name == "aggregator" and (folder / "export").is_dir():
        return folder / "export"
    return folder


def _stream_of(table: str) -> str:
    try:
        return TABLE_STREAM[table]
    except KeyError:
        raise FramesError(f"unknown table {table!r} (known: {', '.join(TABLE_NAMES)})") from None


def _file_for(source: str | os.PathLike[str], stream: str) -> Path:
    p = Path(source)
    if p.is_file():
        return p  # a file given by name is read as ``stream`` whatever it is called
    if not p.exists():
        raise FramesError(f"{p}: no such file or folder")
    path = _export_folder(p) / f"{stream}.jsonl"
    if not path.is_file():
        raise FramesError(f"{p}: no {stream}.jsonl here (was the {stream} stream exported?)")
    return path


# --------------------------------------------------------------------------- reading


def _read(path: Path) -> bytes:
    """The file's bytes, read (not mapped) at once.

    A file that is appended, truncated or rewritten while it is read gives whatever
    bytes ``read`` returned, never a signal (a mapped file cut under its reader kills
    the process with SIGBUS): the caller cuts them after the last complete line, and a
    mix of two versions fails to parse as any bad input does.
    """
    try:
        with open(path, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise FramesError(f"{path}: cannot read ({exc.strerror or exc})") from None


class _File:
    """One file as read: its bytes, and its complete lines (up to ``end``) as an
    Arrow buffer over the same memory, for the parser."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data = _read(path)
        self.end = self.data.rfind(b"\n") + 1
        self.partial = self.end < len(self.data)
        self.body = pa.py_buffer(self.data).slice(0, self.end)


def _line_of(data: bytes, offset: int) -> int:
    return data.count(b"\n", 0, offset) + 1


def _lines(data: bytes, end: int) -> Any:
    """(line number, start, stop) of each line of ``data[:end]`` (stop excludes the newline)."""
    start = 0
    number = 0
    while start < end:
        stop = data.find(b"\n", start, end)
        if stop < 0:
            stop = end
        number += 1
        yield number, start, stop
        start = stop + 1


def _utf8_error(path: Path, data: bytes, end: int) -> FramesError | None:
    """The error naming the first line of ``data[:end]`` with bytes that are not UTF-8
    (decoded some megabytes of whole lines at a time), or None."""
    view = memoryview(data)
    pos = 0
    while pos < end:
        stop = data.find(b"\n", min(pos + (8 << 20), end - 1), end)
        stop = end if stop < 0 else stop + 1
        try:
            str(view[pos:stop], "utf-8")
        except UnicodeDecodeError as exc:
            at = pos + exc.start
            line_start = data.rfind(b"\n", 0, at) + 1
            return FramesError(
                f"{path}:{_line_of(data, at)}: not UTF-8 "
                f"(byte 0x{data[at]:02x} at column {at - line_start + 1})"
            )
        pos = stop
    return None


def _not_utf8(path: Path, data: bytes, end: int) -> FramesError:
    """The error for a file that pyarrow found not UTF-8 (a key or a string value)."""
    found = _utf8_error(path, data, end)
    if found is not None:
        return found
    return FramesError(f"{path}: not UTF-8 (a key or a string holds bytes that are not UTF-8)")


def _malformed_line(path: Path, data: bytes, end: int) -> FramesError | None:
    """The first line that is not one JSON object (what pyarrow's reader lets by: a
    blank line, two objects on one line), as the strict validator words it."""
    loads = orjson.loads
    for number, start, stop in _lines(data, end):
        try:
            obj = loads(data[start:stop])
        except orjson.JSONDecodeError as exc:
            return FramesError(f"{path}:{number}: invalid JSON: {exc}")
        if type(obj) is not dict:
            return FramesError(f"{path}:{number}: expected a JSON object")
    return None


def _longest_line(data: bytes, end: int) -> tuple[int, int]:
    """(length, line number) of the longest line of ``data[:end]``."""
    best = (0, 0)
    for number, start, stop in _lines(data, end):
        if stop - start > best[0]:
            best = (stop - start, number)
    return best


def _parse(file: _File, schema: Any) -> Any:
    """The file's complete lines parsed by pyarrow's JSON reader: the scalar columns typed, every
    other key inferred (so that nothing goes unchecked)."""
    path = file.path
    block = _BLOCK_SIZE
    while True:
        try:
            return pajson.read_json(
                pa.BufferReader(file.body),
                read_options=pajson.ReadOptions(block_size=block),
                parse_options=pajson.ParseOptions(
                    explicit_schema=schema, unexpected_field_behavior="infer"
                ),
            )
        except UnicodeDecodeError:
            raise _not_utf8(path, file.data, file.end) from None
        except pa.ArrowException as exc:
            text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            if "straddl" in text and block < _MAX_BLOCK_SIZE:
                # A line longer than a block: parse again with blocks that hold it.
                length, number = _longest_line(file.data, file.end)
                if length + 1 > _MAX_BLOCK_SIZE:
                    raise FramesError(
                        f"{path}:{number}: a line of {length} bytes, longer than the "
                        f"{_MAX_BLOCK_SIZE} bytes pyarrow's JSON reader can take"
                    ) from None
                block = min(_MAX_BLOCK_SIZE, max(2 * block, 1 << (length + 1).bit_length()))
                continue
            found = None if file.data.isascii() else _utf8_error(path, file.data, file.end)
            found = found or _malformed_line(path, file.data, file.end)
            if found is not None:
                raise found from None
            raise FramesError(
                f"{path}: {text} (load with validate=True to find the line)"
            ) from None


# ------------------------------------------------------------------ value checks
# What the strict validator (``traceml validate``) rejects in a line that pyarrow
# parses, checked column-wise from the schemas: required keys, NaN and Infinity,
# ranges, constants, enums, patterns, unknown keys, the phase timing's rules and the
# identity rules of ``traceml_records._rules``. (Key order, integers written as
# floats and the other cross-field rules are for validate=True.)


@dataclass(frozen=True)
class _Bounds:
    """What a column's schema allows, beyond its Arrow type."""

    name: str
    kind: str
    nullable: bool
    minimum: float | None = None
    maximum: float | None = None
    const: Any = None
    enum: tuple[Any, ...] | None = None
    pattern: str | None = None


def _bounds(name: str, kind: str, nullable: bool, check: ValueCheck) -> _Bounds:
    maximum = check.maximum
    return _Bounds(
        name=name,
        kind=kind,
        nullable=nullable,
        minimum=check.minimum,
        maximum=None if maximum is not None and maximum >= _INT64_MAX else maximum,
        const=check.const if check.has_const else None,
        enum=check.enum,
        pattern=check.pattern,
    )


@dataclass(frozen=True)
class _StreamChecks:
    columns: tuple[_Bounds, ...]
    rules: frozenset[str]
    key_fields: tuple[str, ...]
    unique_keys: bool
    events: ValueCheck | None
    """step_time's ``events`` map, None for other streams."""
    timing: tuple[_Bounds, ...]
    """The phase timing's leaves."""


_ARROW_KIND = {INTEGER: "int64", NUMBER: "float64", BOOLEAN: "bool"}


@functools.cache
def _checks(stream: str) -> _StreamChecks:
    plan = CHECKS[stream]
    columns = tuple(_bounds(n, t, null, plan.field(n).check) for n, t, null in TABLES[stream])
    events = None
    timing: tuple[_Bounds, ...] = ()
    if "events" in NESTED_FIELDS[stream]:
        events = plan.field("events").check
        assert events.value is not None and events.value.value is not None
        timing = tuple(
            _bounds(
                f.name,
                _ARROW_KIND.get(f.check.kind, "string"),
                not f.required or f.check.nullable,
                f.check,
            )
            for f in events.value.value.fields
        )
    return _StreamChecks(
        columns=columns,
        rules=frozenset(plan.rules),
        key_fields=plan.key_fields,
        unique_keys=plan.unique_keys,
        events=events,
        timing=timing,
    )


class _Findings:
    """Bad data lines, found column by column: a row mask, and the first problems."""

    def __init__(self, path: Path, is_data: Any) -> None:
        self.path = path
        self.is_data = is_data
        """Rows that are data lines (closing lines are not checked as data)."""
        self.bad: Any = None
        self.found: list[tuple[int, str, str]] = []

    def check(
        self,
        mask: Any,
        pointer: str,
        message: str,
        *,
        values: Any = None,
    ) -> Any:
        """Record the data lines where ``mask`` (over every row) is true; returns the
        mask limited to data lines. ``message`` may hold ``{value}`` (from ``values``)."""
        mask = pc.and_(pc.fill_null(mask, False), self.is_data)
        if not pc.any(mask).as_py():
            return mask
        if len(self.found) < 4 * _MAX_PROBLEMS:
            for i in pc.indices_nonzero(mask)[:3].to_pylist():
                text = message
                if values is not None and "{value}" in message:
                    text = message.format(value=_show(values[i].as_py()))
                self.found.append((i, pointer, text))
        return mask

    def add(self, mask: Any) -> None:
        """Count the rows of a full-length mask (None: no row) as bad."""
        if mask is not None:
            self.bad = mask if self.bad is None else pc.or_(self.bad, mask)

    def problems(self) -> tuple[str, ...]:
        return tuple(
            f"{self.path}:{row + 1}: {pointer or '/'}: {message}"
            for row, pointer, message in sorted(self.found)[:_MAX_PROBLEMS]
        )


def _show(value: Any) -> str:
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    return repr(value)


def _pointer(*parts: str) -> str:
    return "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def _check_values(f: _Findings, col: Any, b: _Bounds, pointer: str, *, present: Any = None) -> Any:
    """The bad rows of one column (an Array or ChunkedArray) against its bounds.

    ``present``: rows where the column's parent object exists (a missing key there
    is a problem); None for a top-level column.
    """
    bad: list[Any] = []
    if col is None:
        if b.nullable:
            return None
        col = pa.nulls(len(f.is_data) if present is None else len(present), _TYPES[b.kind])
    if not b.nullable:
        missing = pc.is_null(col) if present is None else pc.and_(present, pc.is_null(col))
        bad.append(f.check(missing, pointer, "required key is missing or null"))
    if col.null_count == len(col):
        return _or_all(bad)
    if b.kind == "float64" and pa.types.is_floating(col.type):
        bad.append(
            f.check(
                pc.invert(pc.is_finite(col)),
                pointer,
                "{value} is not a finite number (NaN and Infinity are never written)",
                values=col,
            )
        )
    numeric = pa.types.is_integer(col.type) or pa.types.is_floating(col.type)
    if numeric and b.minimum is not None:
        bad.append(
            f.check(
                pc.less(col, b.minimum),
                pointer,
                f"{{value}} is less than the minimum of {b.minimum}",
                values=col,
            )
        )
    if numeric and b.maximum is not None:
        bad.append(
            f.check(
                pc.greater(col, b.maximum),
                pointer,
                f"{{value}} is greater than the maximum of {b.maximum}",
                values=col,
            )
        )
    if b.const is not None and not isinstance(b.const, bool):
        bad.append(
            f.check(
                pc.not_equal(col, pa.scalar(b.const, col.type)),
                pointer,
                f"{{value}} is not {b.const!r}",
                values=col,
            )
        )
    if b.enum is not None and pa.types.is_string(col.type):
        bad.append(
            f.check(
                # a null is no value (a missing optional key): the check above has it
                pc.and_(
                    pc.is_valid(col),
                    pc.invert(pc.is_in(col, value_set=pa.array(b.enum, pa.string()))),
                ),
                pointer,
                f"{{value}} is not one of {', '.join(map(repr, b.enum))}",
                values=col,
            )
        )
    if b.pattern is not None and pa.types.is_string(col.type):
        bad.append(
            f.check(
                pc.invert(pc.match_substring_regex(col, b.pattern)),
                pointer,
                f"{{value}} does not match {b.pattern!r}",
                values=col,
            )
        )
    return _or_all(bad)


def _or_all(masks: list[Any]) -> Any:
    out = None
    for m in masks:
        if m is not None:
            out = m if out is None else pc.or_(out, m)
    return out


def _find_bad_lines(f: _Findings, raw: Any, stream: str, own: Any, nested: tuple[str, ...]) -> None:
    """Every check of one stream's data lines; the bad rows end in ``f.bad``."""
    checks = _checks(stream)
    names = set(raw.column_names)
    for b in checks.columns:
        col = raw.column(b.name) if b.name in names else None
        f.add(_check_values(f, col, b, _pointer(b.name)))
    known = {*own.names, *nested}
    for name in raw.column_names:
        if name in known:
            continue
        col = raw.column(name)
        if name == "closing":
            # closing true is a closing line; any other value is a data line carrying it.
            f.add(
                f.check(
                    pc.is_valid(col), "/closing", "data lines never carry closing (expected true)"
                )
            )
        else:
            f.add(f.check(pc.is_valid(col), _pointer(name), "unexpected key (not in the schema)"))
    _identity_rules(f, raw, checks.rules, names)
    if checks.events is not None:
        if "events" in names:
            _check_events(f, raw.column("events"), checks)
        else:
            f.add(f.check(pc.is_null(pa.nulls(raw.num_rows)), "/events", "required key is missing"))


_IDENTITY_CHECKS = (
    (
        "rank-equals-global-rank",
        "rank",
        "not_equal",
        "global_rank",
        "rank differs from global_rank",
    ),
    (
        "global-rank-below-world-size",
        "global_rank",
        "greater_equal",
        "world_size",
        "global_rank is not below world_size",
    ),
    (
        "local-rank-below-local-world-size",
        "local_rank",
        "greater_equal",
        "local_world_size",
        "local_rank is not below local_world_size",
    ),
    (
        "local-world-size-within-world-size",
        "local_world_size",
        "greater",
        "world_size",
        "local_world_size exceeds world_size",
    ),
)
"""The identity rules of ``traceml_records._rules``, as column comparisons."""


def _identity_rules(f: _Findings, raw: Any, rules: frozenset[str], names: set[str]) -> None:
    for rule, left, op, right, message in _IDENTITY_CHECKS:
        if rule in rules and left in names and right in names:
            compare = getattr(pc, op)
            f.add(f.check(compare(raw.column(left), raw.column(right)), _pointer(left), message))


def _check_events(f: _Findings, events: Any, checks: _StreamChecks) -> None:
    """The ``events`` map of step_time: names, device keys, and every phase timing.

    Column-wise over the whole file: pyarrow gives the map one struct type for every
    block (the union of the names), null where a line lacks the entry.
    """
    schema = checks.events
    assert schema is not None and schema.value is not None
    reserved = re.compile(schema.reserved_key_pattern or "(?!)")
    allowed = set(schema.reserved_keys)
    device_pattern = re.compile(schema.value.key_pattern or ".*")
    timing = {b.name: b for b in checks.timing}
    duration_rule = "duration-matches-timing" in checks.rules
    n = len(events)
    present = pc.is_valid(events)
    bad: list[Any] = [f.check(pc.invert(present), "/events", "required key is missing")]
    if not pa.types.is_struct(events.type):
        if events.null_count < n:
            raise FramesError(f"{f.path}: events is not an object (got {events.type})")
        f.add(_or_all(bad))
        return
    names = [fld.name for fld in events.type]
    children = events.flatten()  # merges each parent's nulls into its children
    for name in schema.required_keys:
        missing = present
        if name in names:
            missing = pc.and_(present, pc.is_null(children[names.index(name)]))
        bad.append(f.check(missing, "/events", f"required event {name!r} is missing"))
    any_event = None
    for name, by_device in zip(names, children, strict=True):
        here = pc.is_valid(by_device)
        any_event = here if any_event is None else pc.or_(any_event, here)
        at = _pointer("events", name)
        if name == "" or (reserved.search(name) and name not in allowed):
            why = "an empty event name" if name == "" else "a reserved name TraceML never writes"
            bad.append(f.check(here, at, why))
        if not pa.types.is_struct(by_device.type):
            if by_device.null_count < n:
                raise FramesError(f"{f.path}: events/{name} is not an object")
            continue
        any_device = None
        for dev_field, t in zip(by_device.type, by_device.flatten(), strict=True):
            t_here = pc.is_valid(t)
            any_device = t_here if any_device is None else pc.or_(any_device, t_here)
            dev_at = _pointer("events", name, dev_field.name)
            if not device_pattern.search(dev_field.name):
                bad.append(f.check(t_here, dev_at, "device key does not match its pattern"))
            bad.append(_check_timing(f, t, t_here, timing, dev_at, duration_rule))
        if any_device is None:
            bad.append(f.check(here, at, "no device"))
        else:
            bad.append(f.check(pc.and_(here, pc.invert(any_device)), at, "no device"))
    if any_event is None:
        bad.append(f.check(present, "/events", "no event"))
    else:
        bad.append(f.check(pc.and_(present, pc.invert(any_event)), "/events", "no event"))
    f.add(_or_all(bad))


def _check_timing(
    f: _Findings,
    t: Any,
    here: Any,
    bounds: dict[str, _Bounds],
    at: str,
    duration_rule: bool,
) -> Any:
    """One phase timing (a struct column; null where that event/device is absent)."""
    if not pa.types.is_struct(t.type):
        if t.null_count < len(t):
            raise FramesError(f"{f.path}: {at[1:]} is not an object")
        return None
    leaves = dict(zip([x.name for x in t.type], t.flatten(), strict=True))
    bad: list[Any] = []
    for name, col in leaves.items():
        if name not in bounds:
            bad.append(f.check(pc.is_valid(col), at + _pointer(name), "unexpected key"))
    for name, b in bounds.items():
        bad.append(_check_values(f, leaves.get(name), b, at + _pointer(name), present=here))
    is_gpu, gpu_ms = leaves.get("is_gpu"), leaves.get("gpu_ms")
    cpu_ms, duration = leaves.get("cpu_ms"), leaves.get("duration_ms")
    if is_gpu is not None and pa.types.is_boolean(is_gpu.type):
        gpu_null = pc.is_null(gpu_ms) if gpu_ms is not None else here
        bad.append(
            f.check(pc.and_(is_gpu, gpu_null), at + "/gpu_ms", "is_gpu is true but gpu_ms is null")
        )
        if duration_rule and cpu_ms is not None and duration is not None:
            gpu = gpu_ms if gpu_ms is not None else pa.nulls(len(t), pa.float64())
            used = pc.if_else(is_gpu, pc.cast(gpu, pa.float64()), pc.cast(cpu_ms, pa.float64()))
            differs = pc.not_equal(pc.cast(duration, pa.float64()), used)
            bad.append(
                f.check(
                    differs,
                    at + "/duration_ms",
                    "duration_ms is not gpu_ms when is_gpu, nor cpu_ms when not",
                )
            )
    return _or_all(bad)


# --------------------------------------------------------------------------- loading


def _validate(path: Path, data: bytes, end: int) -> None:
    """Check every complete line as ``traceml validate`` checks it on its own, and that
    a closing line is only the last line; raises FramesError naming ``file:line``."""
    from traceml_records._linecheck import validate_line

    lines = data[:end].split(b"\n")[:-1]
    problems: list[str] = []
    count = 0
    closing: tuple[int, dict[str, Any]] | None = None
    for number, raw in enumerate(lines, start=1):
        for problem in validate_line(raw):
            problems.append(f"{path}:{number}: {problem.pointer or '/'}: {problem.message}")
        closing_obj = closing_of(raw)
        if closing_obj is not None and number != len(lines):
            problems.append(f"{path}:{number}: a closing line before the last line")
        elif closing_obj is not None:
            closing = (number, closing_obj)
        else:
            count += 1
        if len(problems) > 5:
            break
    if closing is not None and not problems and closing[1].get("written_records") != count:
        problems.append(
            f"{path}:{closing[0]}: closing line says {closing[1].get('written_records')} "
            f"records, the file has {count}"
        )
    if problems:
        command = shlex.join(["traceml", "validate", str(path)])
        more = f" (and more; run {command})" if len(problems) > 5 else ""
        raise FramesError("; ".join(problems[:5]) + more)


def _empty(stream: str) -> dict[str, Any]:
    tables = {stream: arrow_schema(stream).empty_table()}
    for name in LONG_TABLES:
        if TABLE_STREAM[name] == stream:
            tables[name] = arrow_schema(name).empty_table()
    return tables


def _closing_row(raw: Any, row: int) -> dict[str, Any]:
    """A closing line as its keys (in the schema's order) from the parsed columns."""
    order = CLOSING_CHECK.names
    out: dict[str, Any] = {}
    for key in order:
        value = True if key == "closing" else raw.column(key)[row].as_py()
        if value is not None:
            out[key] = value
    return out


def load(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Loaded:
    """Read one stream's file (or a run/export folder's file of that stream).

    ``stream`` may also be a long table's name (``step_time_phases``); the result
    holds every table of the stream either way. Raises :class:`FramesError` for what
    cannot be read; with ``validate=True`` also for any line ``traceml validate``
    rejects on its own and for a closing line before the last line. Repeated keys are
    counted (:attr:`Loaded.duplicate_keys`), never merged.
    """
    stream = _stream_of(stream)
    path = _file_for(source, stream)
    file = _File(path)
    fast = _load_fast(file, stream)
    if fast is not None:
        return _finish(fast)
    if validate:
        _validate(path, file.data, file.end)
    if file.end == 0:
        return _finish(Loaded(path, stream, _empty(stream), None, file.partial))
    try:
        return _load(file, stream, validate)
    except UnicodeDecodeError:
        # A key that is not UTF-8 (pyarrow decodes field names only when asked).
        raise _not_utf8(path, file.data, file.end) from None


def _load_fast(file: _File, stream: str) -> Loaded | None:
    """The tables straight from the scan's columns, when every line is one it takes as
    the exporter writes it (then every line is valid and no key repeats) and the only
    closing line, if any, is the last, clean, and counts them; None: the general way
    loads the file."""
    layout = frames_layout(stream)
    if layout is None or file.end == 0:
        return None
    scan = FileScan(stream, layout=layout)
    try:
        chunks = scan.read_bytes(file.data)
    except OverflowError:  # a string column past its 32-bit offsets: a line of 2 GiB
        return None
    st = scan.state
    closing = st.closing
    if st.bad or st.taken == 0 or st.written_otherwise:
        return None
    if closing is not None and (
        st.closing_lines != 1
        or st.closing_line != st.lines
        or closing.get("stream") != stream
        or check_closing(closing)
        or closing["written_records"] != st.taken
    ):
        return None
    tables = {stream: _table(arrow_schema(stream), [top for top, _ in chunks])}
    for name in LONG_TABLES:
        if TABLE_STREAM[name] == stream:
            tables[name] = _table(arrow_schema(name), [rows for _, rows in chunks if rows])
    if closing is not None:
        closing = {k: closing[k] for k in CLOSING_CHECK.names if closing.get(k) is not None}
    return Loaded(file.path, stream, tables, closing, file.partial, data_lines=st.taken)


def _table(schema: Any, chunks: list[tuple[Column, ...]]) -> Any:
    """A table of ``schema`` from the fast reader's columns, a chunk per block."""
    columns = []
    for i, fld in enumerate(schema):
        arrays = []
        for chunk in chunks:
            valid, values, offsets, length, nulls = chunk[i]
            buffers = [None if valid is None else pa.py_buffer(valid)]
            if offsets is not None:
                buffers.append(pa.py_buffer(offsets))
            buffers.append(pa.py_buffer(values))
            arrays.append(pa.Array.from_buffers(fld.type, length, buffers, null_count=nulls))
        columns.append(pa.chunked_array(arrays, type=fld.type))
    return pa.Table.from_arrays(columns, schema=schema)


def _load(file: _File, stream: str, validate: bool) -> Loaded:
    path = file.path
    nested = NESTED_FIELDS[stream]
    own = arrow_schema(stream)
    # The scalar columns typed (all nullable here: a missing key is a null, counted
    # as a bad line), the closing line's keys too; everything else is inferred.
    parse_schema = pa.schema(
        [
            *(pa.field(f.name, f.type, nullable=True) for f in own),
            pa.field("closing", pa.bool_()),
            *(pa.field(k, pa.int64()) for k in _CLOSING_FIELDS[1:] if k not in own.names),
        ]
    )
    raw = _parse(file, parse_schema)
    try:
        raw.validate(full=True)  # string values are not UTF-8-checked by the reader
    except pa.ArrowInvalid as exc:
        found = _utf8_error(path, file.data, file.end)
        raise found or FramesError(f"{path}: {str(exc).splitlines()[0]}") from None
    rows = raw.num_rows
    is_closing = pc.fill_null(raw.column("closing"), False)
    closing_rows: list[int] = pc.indices_nonzero(is_closing).to_pylist()
    is_data = pc.invert(is_closing)
    closing = None
    earlier = closing_rows
    if closing_rows and closing_rows[-1] == rows - 1:
        closing, earlier = _closing_row(raw, rows - 1), closing_rows[:-1]
    data_lines = rows - len(closing_rows)

    f = _Findings(path, is_data)
    _find_bad_lines(f, raw, stream, own, nested)
    bad_lines = int(pc.sum(f.bad).as_py() or 0) if f.bad is not None else 0
    notes: list[str] = []
    previous = -1
    for row in closing_rows:
        c = _closing_row(raw, row)
        if row != rows - 1:
            notes.append(f"{path}:{row + 1}: a closing line before the last line")
        if c.get("stream") != stream:
            notes.append(f"{path}:{row + 1}: /stream: a closing line of {c.get('stream')!r}")
        run_lines = row - previous - 1
        if c.get("written_records") != run_lines:
            notes.append(
                f"{path}:{row + 1}: /written_records: {c.get('written_records')} but "
                f"{'its run has' if earlier else 'the file has'} {run_lines} data line(s)"
            )
        previous = row
    if (bad_lines or notes) and file.data.count(b"\n", 0, file.end) != rows:
        # Line numbers are row numbers only when every line is one object.
        found = _malformed_line(path, file.data, file.end)
        if found is not None:
            raise found
    closing_set = set(closing_rows)
    last_data = rows - 1
    while last_data in closing_set:
        last_data -= 1
    runs_concatenated = any(r < last_data for r in earlier)
    earlier_closings = tuple({"line": r + 1, "closing": _closing_row(raw, r)} for r in earlier)
    if validate and (earlier or bad_lines):
        raise FramesError("; ".join([*notes, *f.problems()][:5]))

    drop = is_closing if f.bad is None else pc.or_(is_closing, f.bad)
    dropped = pc.indices_nonzero(drop).to_pylist() if bad_lines or earlier else closing_rows
    if dropped and dropped == list(range(rows - len(dropped), rows)):
        raw = raw.slice(0, rows - len(dropped))  # only the closing line, at the end
    elif dropped:
        raw = raw.filter(pc.invert(drop))

    duplicates, dup_notes = _duplicates(raw, stream)
    problems = tuple([*notes, *f.problems(), *dup_notes][:_MAX_PROBLEMS])

    tables: dict[str, Any] = {}
    n = raw.num_rows
    arrays = [_column(raw, fld.name, fld.type, n) for fld in own]
    tables[stream] = pa.Table.from_arrays(
        [a if isinstance(a, pa.ChunkedArray) else pa.chunked_array([a]) for a in arrays],
        schema=own,
    )
    for name, (source_field, key_names) in LONG_TABLES.items():
        if TABLE_STREAM[name] != stream:
            continue
        if source_field in raw.column_names and n:
            tables[name] = _flatten(raw, source_field, key_names, name)
        else:
            tables[name] = arrow_schema(name).empty_table()
    loaded = Loaded(
        path,
        stream,
        tables,
        closing,
        file.partial,
        data_lines=data_lines,
        bad_lines=bad_lines,
        problems=problems,
        duplicate_keys=duplicates,
        earlier_closings=earlier_closings,
        runs_concatenated=runs_concatenated,
    )
    return _finish(loaded)


def _finish(loaded: Loaded) -> Loaded:
    """The tables with what was left out in their schema metadata."""
    meta = {
        _META_CLOSING: orjson.dumps(loaded.closing),
        _META_PARTIAL: b"true" if loaded.partial_last_line else b"false",
        _META_FILE: os.fsencode(loaded.path),
        _META_INFO: orjson.dumps(loaded.info()),
    }
    for name, table in loaded.tables.items():
        loaded.tables[name] = table.replace_schema_metadata(meta)
    return loaded


def _duplicates(raw: Any, stream: str) -> tuple[int, list[str]]:
    """Rows whose stream key an earlier row has, and a few of those keys (text)."""
    checks = _checks(stream)
    keys = list(checks.key_fields)
    if not checks.unique_keys or raw.num_rows < 2:
        return 0, []
    # A key field the file's lines lack (an optional one: collectives' group and
    # peer_rank in files written before them) is null on every row; nulls group together.
    n = raw.num_rows
    key_table = pa.table({k: raw.column(k) if k in raw.column_names else pa.nulls(n) for k in keys})
    counts = key_table.group_by(keys, use_threads=False).aggregate([([], "count_all")])
    extra = int(pc.sum(counts.column("count_all")).as_py() or 0) - counts.num_rows
    if extra == 0:
        return 0, []
    repeated = counts.filter(pc.greater(counts.column("count_all"), 1)).slice(0, 3)
    notes = []
    for row in repeated.to_pylist():
        shown = ", ".join(f"{k}={row[k]!r}" for k in keys)
        notes.append(f"duplicate key {shown} on {row['count_all']} lines (rows kept, not merged)")
    return extra, notes


def _column(table: Any, name: str, target: Any, rows: int) -> Any:
    if name not in table.column_names:
        return pa.nulls(rows, target)
    col = table.column(name)
    return col if col.type == target else col.cast(target)


def _flatten(raw: Any, source_field: str, key_names: tuple[str, ...], table: str) -> Any:
    """A map column of ``raw`` as a long table: one map level per name of ``key_names``
    (step_time's events: event -> device -> timing; runtime_environment's parallel:
    dimension -> coordinate).

    Block by block of the file, then entry by entry of each level, rows in file order
    within each (sort when the order matters). Zero-copy where every line has the
    entry, a filter where some lack it (or, for a nullable map, have null).
    """
    schema = arrow_schema(table)
    stream_keys = _stream_keys(table, key_names)
    leaf_cols = [f for f in schema if f.name not in key_names and f.name not in stream_keys]
    column = raw.column(source_field)
    keys = [raw.column(k) for k in stream_keys]
    parts = []

    def leaves(key_chunks: list[Any], names: list[str], leaf: Any) -> None:
        mask = None if leaf.null_count == 0 else leaf.is_valid()
        if mask is not None:
            leaf = leaf.filter(mask)
        n = len(leaf)
        if n == 0:
            return
        cols: list[Any] = [k if mask is None else k.filter(mask) for k in key_chunks]
        cols += [pa.repeat(pa.scalar(name, pa.string()), n) for name in names]
        children = (
            dict(zip([f.name for f in leaf.type], leaf.flatten(), strict=True))
            if pa.types.is_struct(leaf.type)
            else {}
        )
        for f in leaf_cols:
            arr = children.get(f.name)
            if arr is None:
                cols.append(pa.nulls(n, f.type))
            else:
                cols.append(arr if arr.type == f.type else arr.cast(f.type))
        parts.append(pa.Table.from_arrays(cols, schema=schema))

    def level(key_chunks: list[Any], names: list[str], value: Any, where: str) -> None:
        if len(names) == len(key_names):
            leaves(key_chunks, names, value)
            return
        if pa.types.is_null(value.type):
            return  # null on every line of the block (a nullable map)
        if not pa.types.is_struct(value.type):
            raise FramesError(f"{where} is not an object (got {value.type}); use validate=True")
        # flatten() merges each parent's nulls into its children.
        for entry, child in zip(value.type, value.flatten(), strict=True):
            level(key_chunks, [*names, entry.name], child, f"{where}/{entry.name}")

    for c, chunk in enumerate(column.chunks):
        level([k.chunk(c) for k in keys], [], chunk, source_field)
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts)


def _stream_keys(table: str, key_names: tuple[str, ...]) -> list[str]:
    """The stream key columns a long table starts with (before its map-key columns)."""
    out = []
    for name, _, _ in TABLES[table]:
        if name in key_names:
            break
        out.append(name)
    return out


def load_arrow(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Any:
    """One table as a ``pyarrow.Table``; the closing line is in its schema metadata
    (read it back with :func:`closing_line`)."""
    return load(source, stream, validate=validate).tables[stream]


def closing_line(table: Any) -> dict[str, Any] | None:
    """The closing line left out of a table from :func:`load_arrow` (None while the
    file is still being written)."""
    meta = table.schema.metadata or {}
    raw = meta.get(_META_CLOSING)
    value = orjson.loads(raw) if raw else None
    return value if isinstance(value, dict) else None


def to_pandas(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Any:
    """One table as a pandas DataFrame; ``df.attrs["traceml"]`` holds what was left out."""
    loaded = load(source, stream, validate=validate)
    df = loaded.tables[stream].to_pandas()
    df.attrs["traceml"] = loaded.info()
    return df


def to_polars(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Any:
    """One table as a polars DataFrame (closing line: use :func:`load` to see it)."""
    try:
        import polars as pl
    except ImportError:
        raise ImportError("to_polars needs polars: pip install polars") from None
    return pl.from_arrow(load_arrow(source, stream, validate=validate))


def register(
    connection: Any, folder: str | os.PathLike[str], *, validate: bool = False
) -> dict[str, dict[str, Any]]:
    """Register one DuckDB view per exported stream, and ``step_time_phases``.

    Returns table name -> what was left out (closing line, partial last line), for
    the tables registered; streams not exported are not registered.
    """
    p = Path(folder)
    if not p.is_dir():
        raise FramesError(f"{p}: not a folder (give a run folder or an export folder)")
    export = _export_folder(p)
    found: dict[str, dict[str, Any]] = {}
    for stream in dict.fromkeys(TABLE_STREAM.values()):
        if not (export / f"{stream}.jsonl").is_file():
            continue
        loaded = load(export, stream, validate=validate)
        for name, table in loaded.tables.items():
            connection.register(name, table)
            found[name] = loaded.info()
    if not found:
        raise FramesError(f"{p}: no export files here")
    return found
