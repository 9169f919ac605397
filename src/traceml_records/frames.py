"""Typed tables from the export files: Arrow, pandas, polars and DuckDB.

The column layouts are generated from the JSON Schemas (``_generated/tables.py``,
documented in docs/reference/tables.md): one table per stream, and
``step_time_phases``, the ``events`` map of step_time flattened to one row per rank,
step, event and device.

Every loader reads a file that is still being written (a last line without its
newline is left out), never returns the closing line as a row (it is reported:
:attr:`Loaded.closing`, the table's metadata, ``DataFrame.attrs``), and with
``validate=True`` checks every line against the schemas first.

pyarrow is needed (the ``frames`` extra); pandas, polars and duckdb only for their
own functions.

Speed: pyarrow's multithreaded JSON reader parses the lines with an explicit schema
for the scalar columns and infers only the ``events`` map, whose keys vary (user
phase names); the map is then flattened column-wise. bench/frames.py compares it
with ``pandas.read_json`` and the untyped ``pyarrow.json.read_json``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

try:
    import pyarrow as pa
    import pyarrow.json as pajson
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "traceml_records.frames needs pyarrow: pip install 'traceml-ai[frames]'"
    ) from exc

from traceml_records._generated.tables import LONG_TABLES, NESTED_FIELDS, TABLE_STREAM, TABLES

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
"""Bytes per parse block: big enough for the threads to stay busy, small for memory."""
_META_CLOSING = b"traceml.closing"
_META_PARTIAL = b"traceml.partial_last_line"
_META_FILE = b"traceml.file"


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

    def info(self) -> dict[str, Any]:
        """What was left out, as JSON-able data (also in each table's metadata)."""
        return {
            "file": str(self.path),
            "closing": self.closing,
            "partial_last_line": self.partial_last_line,
            "data_lines": self.data_lines,
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


def _map(path: Path) -> tuple[Any, int, dict[str, Any] | None, bool]:
    """(file buffer, end of the data lines, closing line, partial last line).

    The file is memory-mapped (no copy); only its tail is read here to find the last
    complete line, so a file being appended is cut at a line boundary.
    """
    if path.stat().st_size == 0:
        return pa.py_buffer(b""), 0, None, False
    buf = pa.memory_map(str(path)).read_buffer()
    size = buf.size
    window = 1 << 16
    while True:
        start = max(0, size - window)
        tail = buf.slice(start).to_pybytes()
        last_nl = tail.rfind(b"\n")
        prev_nl = tail.rfind(b"\n", 0, last_nl) if last_nl > 0 else -1
        if start > 0 and prev_nl < 0:
            window *= 4  # a very long last line: look further back
            continue
        break
    if last_nl < 0:
        return buf, 0, None, True
    end = start + last_nl + 1
    partial = end < size
    line_start = start + prev_nl + 1
    last = tail[prev_nl + 1 : last_nl + 1]
    closing = None
    # A closing line is always the last line; its key order is fixed by the schema.
    if b'"closing":true' in last:
        try:
            obj = orjson.loads(last)
        except orjson.JSONDecodeError:
            obj = None
        if isinstance(obj, dict) and obj.get("closing") is True:
            closing = obj
            end = line_start
    return buf, end, closing, partial


def _validate(path: Path, body: bytes, closing: dict[str, Any] | None) -> int:
    """Check every data line (and the closing line's count); returns the data lines."""
    from traceml_records._validate import validate_line

    problems: list[str] = []
    count = 0
    for number, raw in enumerate(body.split(b"\n")[:-1], start=1):
        count += 1
        for problem in validate_line(raw):
            if len(problems) < 5:
                problems.append(f"{path}:{number}: {problem.pointer or '/'}: {problem.message}")
            if b'"closing":true' in raw:
                problems.append(f"{path}:{number}: a closing line before the last line")
    if closing is not None:
        for problem in validate_line(orjson.dumps(closing)):
            problems.append(f"{path}: closing line: {problem.pointer or '/'}: {problem.message}")
        if closing.get("written_records") != count:
            problems.append(
                f"{path}: closing line says {closing.get('written_records')} records, "
                f"the file has {count}"
            )
    if problems:
        more = f" (and more; run traceml validate {path})" if len(problems) >= 5 else ""
        raise FramesError(
            problems[0] + more if len(problems) == 1 else "; ".join(problems[:5]) + more
        )
    return count


def _column(table: Any, name: str, target: Any, rows: int) -> Any:
    if name not in table.column_names:
        return pa.nulls(rows, target)
    col = table.column(name)
    return col if col.type == target else col.cast(target)


def _flatten(raw: Any, source_field: str, key_names: tuple[str, ...], table: str) -> Any:
    """The map column (event -> device -> timing) of ``raw`` as a long table.

    Block by block of the file, then event by event and device by device, rows in
    file order within each (sort when the order matters). Zero-copy where every line
    has the entry, a filter where some lack it.
    """
    schema = arrow_schema(table)
    stream_keys = _stream_keys(table, key_names)
    leaf_cols = [f for f in schema if f.name not in key_names and f.name not in stream_keys]
    events = raw.column(source_field)
    keys = [raw.column(k) for k in stream_keys]
    parts = []
    for c, chunk in enumerate(events.chunks):
        if not pa.types.is_struct(chunk.type):
            raise FramesError(
                f"{source_field} is not an object (got {chunk.type}); use validate=True"
            )
        key_chunks = [k.chunk(c) for k in keys]
        # flatten() merges each parent's nulls into its children.
        for ev_field, by_device in zip(chunk.type, chunk.flatten(), strict=True):
            if not pa.types.is_struct(by_device.type):
                raise FramesError(
                    f"{source_field}/{ev_field.name} is not an object; use validate=True"
                )
            for dev_field, timing in zip(by_device.type, by_device.flatten(), strict=True):
                mask = None if timing.null_count == 0 else timing.is_valid()
                if mask is not None:
                    timing = timing.filter(mask)
                n = len(timing)
                if n == 0:
                    continue
                cols: list[Any] = [k if mask is None else k.filter(mask) for k in key_chunks]
                cols.append(pa.repeat(pa.scalar(ev_field.name, pa.string()), n))
                cols.append(pa.repeat(pa.scalar(dev_field.name, pa.string()), n))
                children = (
                    dict(zip([f.name for f in timing.type], timing.flatten(), strict=True))
                    if pa.types.is_struct(timing.type)
                    else {}
                )
                for f in leaf_cols:
                    arr = children.get(f.name)
                    if arr is None:
                        cols.append(pa.nulls(n, f.type))
                    else:
                        cols.append(arr if arr.type == f.type else arr.cast(f.type))
                parts.append(pa.Table.from_arrays(cols, schema=schema))
    if not parts:
        return schema.empty_table()
    return pa.concat_tables(parts)


def load(
    source: str | os.PathLike[str], stream: str = "step_time", *, validate: bool = False
) -> Loaded:
    """Read one stream's file (or a run/export folder's file of that stream).

    ``stream`` may also be a long table's name (``step_time_phases``); the result
    holds every table of the stream either way.
    """
    stream = _stream_of(stream)
    path = _file_for(source, stream)
    try:
        buf, end, closing, partial = _map(path)
    except OSError as exc:
        raise FramesError(f"{path}: cannot read ({exc.strerror or exc})") from None
    body = buf.slice(0, end)
    data_lines = _validate(path, body.to_pybytes(), closing) if validate else 0
    nested = NESTED_FIELDS[stream]
    own = arrow_schema(stream)
    tables: dict[str, Any] = {}
    if end == 0:
        tables[stream] = own.empty_table()
        for name in LONG_TABLES:
            if TABLE_STREAM[name] == stream:
                tables[name] = arrow_schema(name).empty_table()
    else:
        # Parse the scalar columns as typed (all nullable here: a missing key is a null,
        # which validate=True reports) and infer only the nested map fields.
        parse_schema = pa.schema([pa.field(f.name, f.type, nullable=True) for f in own])
        try:
            raw = pajson.read_json(
                pa.BufferReader(body),
                read_options=pajson.ReadOptions(block_size=_BLOCK_SIZE),
                parse_options=pajson.ParseOptions(
                    explicit_schema=parse_schema,
                    unexpected_field_behavior="infer" if nested else "ignore",
                ),
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise FramesError(
                f"{path}: {first} (load with validate=True to find the line)"
            ) from None
        rows = raw.num_rows
        data_lines = rows
        arrays = [_column(raw, f.name, f.type, rows) for f in own]
        tables[stream] = pa.Table.from_arrays(
            [a if isinstance(a, pa.ChunkedArray) else pa.chunked_array([a]) for a in arrays],
            schema=own,
        )
        for name, (source_field, key_names) in LONG_TABLES.items():
            if TABLE_STREAM[name] != stream:
                continue
            if source_field in raw.column_names:
                tables[name] = _flatten(raw, source_field, key_names, name)
            else:
                tables[name] = arrow_schema(name).empty_table()
    meta = {
        _META_CLOSING: orjson.dumps(closing),
        _META_PARTIAL: b"true" if partial else b"false",
        _META_FILE: os.fsencode(path),
    }
    tables = {k: t.replace_schema_metadata(meta) for k, t in tables.items()}
    return Loaded(path, stream, tables, closing, partial, data_lines)


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
